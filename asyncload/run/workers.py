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
from concurrent.futures import Future
from typing import Any, Callable

import cv2
import torch

from ..autotune import Gate

Job = Callable[[], None]


class DecodeWorkers:
    """``count`` threads running jobs in the order they were submitted, within the tuner's
    ``gate`` when there is one. ``stop`` is bounded: a thread stuck in a job cannot hold it."""

    def __init__(self, count: int, gate: Gate | None, name: str = "asyncload-decode") -> None:
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._gate = gate
        self._count = count
        self._name = name
        self._stopping = False
        native_threads.acquire()
        self.threads: list[threading.Thread] = []
        # Each Thread.start() waits for the new thread to run, which under a busy GIL takes a while:
        # a starter thread starts them, so the epoch's first jobs are queued meanwhile.
        self._starter = threading.Thread(target=self._start_threads, name=f"{name}-starter", daemon=True)
        self._starter.start()

    def _start_threads(self) -> None:
        for number in range(self._count):
            if self._stopping:
                return
            thread = threading.Thread(target=self._work, name=f"{self._name}-{number}", daemon=True)
            thread.start()
            self.threads.append(thread)

    def submit(self, job: Job) -> None:
        self._jobs.put(job)

    def run_async(self, loop: asyncio.AbstractEventLoop, function: Callable[..., Any], *args: Any) -> asyncio.Future:
        """``function(*args)`` on a decode thread, awaitable on ``loop`` (for the rare paths that
        need a result back on the loop: the first sample, which teaches the batch layout)."""
        future: Future = Future()

        def job() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(function(*args))
            except BaseException as error:  # the awaiting coroutine re-raises it
                future.set_exception(error)

        self.submit(job)
        return asyncio.wrap_future(future, loop=loop)

    def _work(self) -> None:
        torch.set_num_threads(1)  # per thread: the user's own threads keep their setting
        while True:
            job = self._jobs.get()
            if job is None or self._stopping:
                return
            if self._gate is None:
                job()
            else:
                with self._gate:
                    job()

    def all_threads(self) -> list[threading.Thread]:
        """Every thread this pool started (the starter included), for a bounded wait on them."""
        return [self._starter, *self.threads]

    def stop(self) -> None:
        """Lets no queued job start; each thread ends after the job it runs. Does not wait: the
        caller waits on ``all_threads()`` within its own bound. Safe to call again."""
        if not self._stopping:
            self._stopping = True
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
