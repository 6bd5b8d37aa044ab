"""Blocking calls (sync filesystem reads, a user's sync ``read``, local files) on a bounded set of
threads, each with a timeout counted from when the call starts on a thread.

A thread running a call cannot be stopped: a read stuck in the kernel (a hung network mount, a
FIFO with no writer) keeps its thread until the call returns. Two rules keep that from turning
into false failures or a stalled epoch (a ``ThreadPoolExecutor`` keeps neither):

- the timeout runs from the start of the call, not from its submission, so a read that waited
  in the queue behind slow ones is not charged for the wait;
- a call past its timeout fails (its caller retries or records the failure) and its thread
  counts as lost: a new thread takes its place at once, and the lost one ends when its call
  returns. So ``threads`` threads always serve the queue, and stuck reads never fill it.

Every wait is bounded: a call waits in the queue at most ``QUEUED_LIMIT`` timeouts, then fails.
At most ``MAX_LOST_FACTOR * threads`` threads may be lost at once; while that many are stuck,
new calls fail at once (``StuckCalls``) instead of queueing behind storage that hangs that much.
A lost thread that returns frees its place, so the pool recovers with the storage.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

MAX_LOST_FACTOR = 4
SLICE_S = 0.5  # call(): how often a waiting caller looks whether the pool was shut down
QUEUED_LIMIT = 4  # call(): read timeouts a call may wait for a thread before it gives up


def timeout_error(name: str, seconds: float) -> TimeoutError:
    """The error of a call that ran ``seconds``, the limit the user set as ``name``: it says so
    and which setting it was (a bare ``TimeoutError()`` reads "TimeoutError: ", a riddle)."""
    return TimeoutError(f"timed out after {name}={seconds:g} s")


async def to_the_end(work: asyncio.Future) -> Any:
    """``work``'s result, and when the caller is cancelled meanwhile, ``work`` still awaited to
    its end before the cancel goes on: a pool thread cannot be stopped, so what it uses (a
    descriptor it writes, a lock, a store) must not be closed or released under it."""
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        while not work.done():
            try:
                await asyncio.wait([work])
            except asyncio.CancelledError:
                pass  # cancelled again: still wait for the thread
        raise


class StuckCalls(RuntimeError):
    """Too many calls are stuck past their timeout: no thread is started for more."""


@dataclass
class Call:
    future: Future
    function: Callable[..., Any]
    args: tuple
    on_start: Callable[[], Any] | None = None
    started: float | None = None  # time.monotonic() when a thread took it
    thread: threading.Thread | None = field(default=None, repr=False)


class BlockingCalls:
    """``threads`` threads named ``name``-N (started as calls come), see the module.
    ``timeout_name``: what the user calls the timeout, for the message of a call that times out."""

    def __init__(self, threads: int, name: str, timeout_name: str = "timeout") -> None:
        self.threads = max(1, threads)
        self.name = name
        self.timeout_name = timeout_name
        self._queue: queue.SimpleQueue[Call | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._workers: set[threading.Thread] = set()
        self._lost: set[threading.Thread] = set()  # running a call past its timeout; replaced
        self.max_lost = MAX_LOST_FACTOR * self.threads
        self._names = itertools.count()
        self._closed = False

    def submit(self, function: Callable[..., Any], *args: Any, on_start: Callable[[], Any] | None = None) -> Call:
        """Queues ``function(*args)``; ``on_start`` is called on the thread when it starts."""
        call = Call(Future(), function, args, on_start)
        with self._lock:
            if self._closed:
                raise RuntimeError("these blocking calls are shut down")
            if len(self._lost) >= self.max_lost:
                raise StuckCalls(f"{len(self._lost)} calls are stuck past {self.timeout_name} and still running, the "
                                 f"most this loader starts threads for ({self.max_lost}): "
                                 f"the storage or the read hangs; no more calls start until some return")
            if len(self._workers) - len(self._lost) < self.threads:
                self._spawn()
        self._queue.put(call)
        return call

    def _spawn(self) -> None:
        thread = threading.Thread(target=self._work, name=f"{self.name}_{next(self._names)}", daemon=True)
        self._workers.add(thread)
        thread.start()

    def _work(self) -> None:
        me = threading.current_thread()
        while True:
            call = self._queue.get()
            if call is None:
                break
            if not call.future.set_running_or_notify_cancel():
                continue
            call.thread, call.started = me, time.monotonic()
            try:
                if call.on_start is not None:
                    call.on_start()
                result = call.function(*call.args)
            except BaseException as error:
                call.future.set_exception(error)
            else:
                call.future.set_result(result)
            del call
            with self._lock:
                if me in self._lost:  # its place was taken while it was stuck
                    break
        with self._lock:
            self._lost.discard(me)
            self._workers.discard(me)

    def call(self, function: Callable[..., Any], *args: Any, timeout: float) -> Any:
        """``function(*args)`` on a pool thread, for a thread that may block (a decode thread):
        raises ``TimeoutError`` once the call has run ``timeout`` seconds, or has waited
        ``QUEUED_LIMIT`` of them for a thread. One wait on the future in the usual case; the
        start time is looked at only when that wait times out. A ``TimeoutError`` the function
        raises itself (``ETIMEDOUT`` from a soft network mount) is its own error, not the wait's:
        it propagates as it is, at once (the future is done then)."""
        call = self.submit(function, *args)
        queued = time.monotonic()
        while True:
            try:  # in slices: a shutdown must not leave the caller waiting out a whole timeout
                return call.future.result(min(timeout, SLICE_S))
            except TimeoutError:
                if call.future.done():  # the function's own error (or a result just in): as it is
                    return call.future.result()
                if self._closed:
                    call.future.cancel()
                    raise RuntimeError("these blocking calls are shut down") from None
                started, now = call.started, time.monotonic()
                if started is not None and now - started >= timeout:
                    self._timed_out(call)
                    raise timeout_error(self.timeout_name, timeout) from None
                if started is None and now - queued >= QUEUED_LIMIT * timeout and call.future.cancel():
                    raise self._queued_too_long(timeout) from None

    async def call_async(self, function: Callable[..., Any], *args: Any, timeout: float) -> Any:
        """As ``call``, awaited on an event loop (whose thread must not block)."""
        loop = asyncio.get_running_loop()
        began = loop.create_future()

        def on_start() -> None:
            loop.call_soon_threadsafe(lambda: began.done() or began.set_result(None))

        call = self.submit(function, *args, on_start=on_start)
        result = asyncio.wrap_future(call.future)
        try:
            await asyncio.wait([began, result], timeout=QUEUED_LIMIT * timeout, return_when=asyncio.FIRST_COMPLETED)
            queued_too_long = call.started is None and call.future.cancel()  # every thread busy or stuck
            if not queued_too_long:
                return await asyncio.wait_for(asyncio.shield(result), timeout)
        except asyncio.TimeoutError:
            if call.future.done():  # the function's own TimeoutError (or a result just in): as it is
                return call.future.result()
            self._timed_out(call)
            raise timeout_error(self.timeout_name, timeout) from None
        except asyncio.CancelledError:
            call.future.cancel()  # if still queued; a running call ends by itself
            raise
        finally:
            began.cancel()
        raise self._queued_too_long(timeout)

    def _queued_too_long(self, timeout: float) -> TimeoutError:
        return TimeoutError(f"timed out waiting {QUEUED_LIMIT * timeout:g} s ({QUEUED_LIMIT} x {self.timeout_name}) "
                            f"for a thread free to start it")

    def _timed_out(self, call: Call) -> None:
        """``call`` ran past its timeout: its thread is lost, and a new thread takes its place
        unless ``max_lost`` threads are stuck (then ``submit`` refuses new calls)."""
        with self._lock:
            if call.future.done() or call.thread is None or call.thread in self._lost or self._closed:
                return
            self._lost.add(call.thread)
            if len(self._lost) <= self.max_lost:
                self._spawn()

    def shutdown(self, timeout: float) -> bool:
        """Cancels queued calls and waits up to ``timeout`` s for the running ones, but not for
        those already past their timeout (their callers have moved on; their threads end when
        the calls return). True when every thread waited for has ended."""
        with self._lock:
            self._closed = True
            workers = [worker for worker in self._workers if worker not in self._lost]
        while True:
            try:
                call = self._queue.get_nowait()
            except queue.Empty:
                break
            if call is not None:
                call.future.cancel()
        for _ in workers:
            self._queue.put(None)
        deadline = time.monotonic() + timeout
        for thread in workers:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in workers)
