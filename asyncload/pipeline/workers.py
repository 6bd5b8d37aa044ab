"""The decode threads: plain threads taking jobs from one queue.

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
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

import cv2
import torch

from ..gates import Gate
from ..io.blocking import MAX_LOST_FACTOR  # as for reads: stuck threads replaced, at most this many per thread
from .slots import Slot
from .threads import wait_ended

Job = Callable[[], None]
STOP_GRACE_S = 1.0  # wind_down: how long a stop lets the decodes in flight finish before abandoning them
_current = threading.local()  # .slot: the decode thread's own Slot


def current_slot() -> Slot:
    """The calling decode thread's slot (a fresh one, never watched, on any other thread)."""
    slot = getattr(_current, "slot", None)
    return slot if slot is not None else Slot(threading.current_thread())


class DecodeWorkers:
    """``count`` threads running jobs in the order they were submitted, within the tuner's
    ``gate`` when there is one. ``stop`` is bounded: a thread stuck in a job cannot hold it.
    A thread whose decode was abandoned (``slots.py``) is lost: another takes its place, up to
    ``MAX_LOST_FACTOR * count`` lost at once."""

    def __init__(self, count: int, gate: Gate | None, name: str = "asyncload-decode") -> None:
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._gate = gate
        self._count = count
        self._name = name
        self._stopping = False
        native_threads.acquire()
        self.slots: list[Slot] = []  # one per started thread, the lost ones' included
        self._lock = threading.Lock()  # threads and slots: the starter, the watchdog and close() add and read
        self._numbers = 0
        self.max_lost = MAX_LOST_FACTOR * count
        # Each Thread.start() waits for the new thread to run, which under a busy GIL takes a while:
        # a starter thread starts them, so the epoch's first jobs are queued meanwhile.
        self._starter = threading.Thread(target=self._start_threads, name=f"{name}-starter", daemon=True)
        self._starter.start()

    def _start_threads(self) -> None:
        for _ in range(self._count):
            if self._stopping:
                return
            self._start_one()

    def _start_one(self) -> None:
        with self._lock:
            thread = self._new_thread()
        thread.start()

    def _new_thread(self) -> threading.Thread:
        """A thread and its slot, not started yet (under ``_lock``)."""
        thread = threading.Thread(target=self._work, name=f"{self._name}-{self._numbers}", daemon=True)
        self._numbers += 1
        self.slots.append(Slot(thread))
        return thread

    def _end_lost(self, slot: Slot) -> None:
        """On a lost thread whose decode returned at last: it ends, and if fewer than ``count``
        threads serve the queue (``replace`` started none past ``max_lost``), one takes its place
        now. A child's pipeline lives for all epochs: without this its pool would shrink to no
        thread, and the next epoch wait for ever."""
        with self._lock:
            self.slots.remove(slot)
            serving = sum(not other.abandoned for other in self.slots)
            thread = self._new_thread() if not self._stopping and serving < self._count else None
        if thread is not None:
            thread.start()

    def lost(self) -> list[Slot]:
        """The slots of threads whose decode was abandoned and is still running (those that
        ended are forgotten)."""
        with self._lock:
            self.slots = [slot for slot in self.slots if not slot.abandoned or slot.thread.is_alive()]
            return [slot for slot in self.slots if slot.abandoned]

    def serving(self) -> int:
        """How many threads take jobs (not lost; those about to be started included)."""
        with self._lock:
            return len(self.slots) - sum(slot.abandoned for slot in self.slots) if self.slots else self._count

    def replace(self) -> bool:
        """A thread's decode was abandoned: start another in its place. False when ``max_lost``
        threads are stuck already (none is started: the pipeline cannot go on)."""
        self._let_go()
        if self._stopping:
            return True
        if len(self.lost()) > self.max_lost:
            return False
        self._start_one()
        return True

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

    def abandon_all(self) -> None:
        """Abandons every decode in flight (``Slot.abandon``): closing never waits for one."""
        with self._lock:
            slots = list(self.slots)
        for slot in slots:
            if slot.abandon():
                self._let_go()

    def _let_go(self) -> None:
        """An abandoned thread's place in the tuner's gate goes back now (the gate outlives this
        pool); the thread, when its job ever returns, does not give it back again (``_work``)."""
        if self._gate is not None:
            self._gate.__exit__()

    def submit(self, job: Job) -> None:
        self._jobs.put(job)

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

    def _work(self) -> None:
        torch.set_num_threads(1)  # per thread: the user's own threads keep their setting
        with self._lock:
            slot = next(slot for slot in self.slots if slot.thread is threading.current_thread())
        _current.slot = slot
        while True:
            job = self._jobs.get()
            if job is None or self._stopping:
                return
            if self._gate is None:
                job()
            else:
                self._gate.__enter__()
                try:
                    job()
                finally:
                    if not slot.abandoned:  # else its place went back when it was abandoned
                        self._gate.__exit__()
            if slot.abandoned:  # another thread has taken its place (or none could: see _end_lost)
                self._end_lost(slot)
                return

    def all_threads(self) -> list[threading.Thread]:
        """Every thread this pool started (the starter included) but those whose decode was
        abandoned (they write nothing more and end when it returns), for a bounded wait."""
        with self._lock:
            return [self._starter, *(slot.thread for slot in self.slots if not slot.abandoned)]

    def stop(self) -> None:
        """Lets no queued job start; each thread ends after the job it runs. Does not wait: the
        caller waits on ``all_threads()`` within its own bound. Safe to call again."""
        with self._lock:  # _end_lost starts no thread once this is set: each running one gets a None
            stopping, self._stopping = self._stopping, True
        if not stopping:
            native_threads.release()
            for _ in range(self._count):  # one for each thread, started or about to be
                self._jobs.put(None)


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
