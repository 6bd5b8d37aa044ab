"""The decode threads: plain threads taking jobs from one queue (``io/blocking``'s pool, the one
that gives up on stuck threads; here a watchdog decides when, see ``watchdog.py``).

A ``ThreadPoolExecutor`` costs a ``Future``, a work item and a wake-up under a lock for every
call, and ``run_in_executor`` adds a callback back through the event loop: at thousands of
samples a second that Python, under one GIL, became the loader's ceiling. Here a job is a
callable that does a whole chunk of a batch (read, decode, write its rows) and reports the
chunk itself, so the per-sample cost is the decode call and a few clock reads.

Native libraries must not start a thread pool inside each decode thread (16 decode threads ×
OpenCV's 16 threads oversubscribe the cores): each thread sets torch's intra-op threads to one
for itself (an OpenMP setting that is per thread), and while any run is active OpenCV's pool is
set to one thread; the user's own value is restored when the last run stops (``native_threads``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

import cv2
import torch

from ..gates import Gate
from ..io import blocking
from ..io.blocking import AbandoningPool
from .watchdog import Slot
from .threads import wait_ended

STOP_GRACE_S = 1.0  # wind_down: how long a stop lets the decodes in flight finish before abandoning them


def current_slot() -> Slot:
    """The calling decode thread's slot (a fresh one, never watched, on any other thread)."""
    return blocking.current_slot(Slot)  # type: ignore[return-value]


class DecodeWorkers(AbandoningPool):
    """``count`` threads running jobs in the order they were submitted, within the tuner's
    ``gate`` when there is one: ``io/blocking``'s pool, whose stuck threads are replaced (here the
    watchdog, ``watchdog.py``, abandons a decode past ``decode_timeout``), up to
    ``MAX_LOST_FACTOR * count`` lost at once. ``stop`` is bounded: a thread stuck in a job cannot
    hold it. What is the decode's own: each thread's torch setting, OpenCV's, and the stop's grace."""

    def __init__(self, count: int, gate: Gate | None, name: str = "asyncload-decode") -> None:
        native_threads.acquire()
        super().__init__(count, name, slot=Slot, gate=gate, eager=True)

    def thread_started(self) -> None:
        torch.set_num_threads(1)  # per thread: the user's own threads keep their setting

    def wind_down(self, deadline: float | None, decode_timeout: float | None) -> None:
        """``stop``, then a short grace for the decodes in flight (an early ``break`` stops
        mid-batch): abandoning one would poison its buffer until it returns; past the grace
        (``STOP_GRACE_S`` or ``decode_timeout`` if shorter, within ``deadline``) the rest are
        abandoned: a decode that never returns must not hold the stop."""
        self.stop()
        grace = STOP_GRACE_S if decode_timeout is None else min(STOP_GRACE_S, decode_timeout)
        until = time.monotonic() + grace
        wait_ended(self.all_threads(), until if deadline is None else min(deadline, until))
        self.abandon_all()

    def run_async(self, loop: asyncio.AbstractEventLoop, function: Callable[..., Any], *args: Any) -> asyncio.Future:
        """``function(*args)`` on a decode thread, awaitable on ``loop`` (for the rare paths that
        need a result back on the loop: the first sample, which teaches the batch layout)."""
        future: Future = Future()

        def on_timeout(slot: Slot, cause: BaseException, submit: Any) -> None:
            future.set_exception(cause)  # the watchdog won the slot: the thread sets nothing

        def job() -> None:
            if not future.set_running_or_notify_cancel():
                return
            slot = current_slot()
            slot.on_timeout, slot.writes = on_timeout, None
            slot.started = time.perf_counter()
            try:
                result = function(*args)
            except BaseException as error:  # the awaiting coroutine re-raises it
                if slot.claim():
                    future.set_exception(error)
            else:
                if slot.claim():
                    future.set_result(result)

        self.submit(job)
        return asyncio.wrap_future(future, loop=loop)

    def stop(self) -> bool:
        """As the pool's; the first stop gives OpenCV's thread setting back (``native_threads``)."""
        if not super().stop():
            return False
        native_threads.release()
        return True


class _NativeThreads:
    """OpenCV's thread pool is one setting for the whole process: set it to one thread while a
    run is active and give the user's value back when the last run ends (unless the user changed
    it meanwhile)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = 0
        self._saved: int | None = None

    def acquire(self) -> None:
        with self._lock:
            self._active += 1
            if self._active == 1:
                self._saved = cv2.getNumThreads()
                cv2.setNumThreads(1)

    def release(self) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0 and self._saved is not None:
                if cv2.getNumThreads() == 1:
                    cv2.setNumThreads(self._saved)
                self._saved = None


native_threads = _NativeThreads()
