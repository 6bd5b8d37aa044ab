"""The one pool of threads that gives up on a stuck call, and its blocking calls (sync filesystem
reads, a user's sync ``read``, local files) with a timeout counted from when the call starts.

A thread running a call cannot be stopped: a read stuck in the kernel (a hung network mount, a
FIFO with no writer) or a user's decode that never returns keeps its thread until the call
returns. ``AbandoningPool`` keeps that from stalling an epoch (a ``ThreadPoolExecutor`` cannot):
each thread writes when its call starts in its ``CallSlot`` (two attribute stores, no lock) and
``claim``s the result under the slot's lock before anything is written; whoever sees the call
past its timeout ``abandon``s it under the same lock, so exactly one side wins. An abandoned
call's thread is lost: a new thread takes its place at once, and the lost one ends when its call
returns, writing nothing. So ``count`` threads always serve the queue, up to
``MAX_LOST_FACTOR * count`` lost at once (past that the pool starts no more: the user hears the
storage or the decode hangs, instead of the machine filling with threads). A job is a plain
callable: no future, no lock, no wake-up beyond the queue's, since the decode threads run
thousands a second under one GIL.

Two users, who differ only in who watches the clock:

- ``BlockingCalls`` (below; the reader's sync reads): the caller waits on its call's future and
  abandons it once it has run ``timeout`` seconds. The timeout runs from the start of the call,
  not its submission, so a read that waited in the queue behind slow ones is not charged for the
  wait; a call waits in the queue at most ``QUEUED_LIMIT`` timeouts, then fails; while
  ``max_lost`` threads are stuck, new calls fail at once (``StuckCalls``).
- ``pipeline/workers.DecodeWorkers``: a job decodes many rows; a watchdog on the event loop
  (``pipeline/watchdog.Watchdog``) looks at the slots and abandons a decode past ``decode_timeout``,
  failing that one sample; a buffer the stuck decode may still write is poisoned meanwhile.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

Job = Callable[[], None]

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


class CallSlot:
    """One pool thread's current call: ``started`` (``time.perf_counter()``, None when none runs)
    and whether it was ``abandoned``. A subclass keeps what its jobs need beside it (the decode's
    ``pipeline/watchdog.Slot``) and may act at the two rare moments, ``given_up`` and ``returned_late``."""

    __slots__ = ("lock", "started", "abandoned", "thread")

    def __init__(self, thread: threading.Thread) -> None:
        self.lock = threading.Lock()
        self.started: float | None = None
        self.abandoned = False
        self.thread = thread

    def claim(self) -> bool:
        """On the pool thread, once the call returned: True if its result may be written; False
        if it was abandoned (the thread then writes nothing and ends)."""
        with self.lock:
            if self.abandoned:
                self.returned_late()
                return False
            self.started = None
            return True

    def abandon(self, started: float | None = None) -> bool:
        """On the thread that watches the clock (or a closing one): True if the call in flight
        (the one that began at ``started``, if given: not one begun since it was looked at) is
        abandoned now. Then call the pool's ``replace``."""
        with self.lock:
            if self.started is None or self.abandoned or (started is not None and self.started != started):
                return False
            self.abandoned = True
            self.given_up()
            return True

    def given_up(self) -> None:
        """Under the lock, as the call is abandoned (its thread may still write what it writes)."""

    def returned_late(self) -> None:
        """Under the lock, on the thread, when an abandoned call returned at last."""


_current = threading.local()  # .slot: a pool thread's own slot


def current_slot(default: type[CallSlot] = CallSlot) -> CallSlot:
    """The calling pool thread's slot (a fresh ``default``, never watched, on any other thread)."""
    slot = getattr(_current, "slot", None)
    return slot if slot is not None else default(threading.current_thread())


class AbandoningPool:
    """``count`` threads named ``name``-N running jobs in the order they were submitted (see the
    module), within ``gate`` when there is one (a tuner's limit on how many work at once). With
    ``eager`` a starter thread starts them all at once (the decode: the epoch's first jobs are
    queued meanwhile, as each ``Thread.start()`` waits for the new thread to run); else one starts
    per ``ensure_serving()`` while fewer serve. ``slot``: the class of each thread's slot.
    ``on_dropped(job)``: called for each queued job a stop keeps from running."""

    def __init__(self, count: int, name: str, *, slot: type[CallSlot] = CallSlot, gate: Any = None,
                 eager: bool = False, on_dropped: Callable[[Any], None] | None = None) -> None:
        self.count = max(1, count)
        self.name = name
        self.max_lost = MAX_LOST_FACTOR * self.count
        self._slot = slot
        self._gate = gate
        self._on_dropped = on_dropped
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # slots and lost: the starter, the watchers and stop() add and read
        self.slots: list[CallSlot] = []  # one per started thread but those lost and ended
        self._lost: set[CallSlot] = set()  # abandoned, their calls still running
        self._numbers = 0
        self.stopping = False
        self._starter: threading.Thread | None = None
        if eager:
            self._starter = threading.Thread(target=self._start_threads, name=f"{name}-starter", daemon=True)
            self._starter.start()

    def _start_threads(self) -> None:
        for _ in range(self.count):
            if self.stopping:
                return
            self._start_one()

    def _start_one(self) -> None:
        with self._lock:
            if self.stopping:  # a stop's all_threads() would not wait for it
                return
            thread = self._new_thread()
        thread.start()

    def _new_thread(self) -> threading.Thread:
        """A thread and its slot, not started yet (under ``_lock``)."""
        thread = threading.Thread(target=self._work, name=f"{self.name}-{self._numbers}", daemon=True)
        self._numbers += 1
        self.slots.append(self._slot(thread))
        return thread

    def ensure_serving(self) -> None:
        """Starts a thread if fewer than ``count`` serve the queue (a lazy pool, at each submit)."""
        with self._lock:
            thread = None if self.stopping or len(self.slots) - len(self._lost) >= self.count else self._new_thread()
        if thread is not None:
            thread.start()

    def submit(self, job: Job) -> None:
        self._jobs.put(job)

    def lost(self) -> list[CallSlot]:
        """The slots of threads whose call was abandoned and is still running."""
        with self._lock:
            return list(self._lost)

    def serving(self) -> int:
        """How many threads take jobs (not lost; those an eager pool is about to start included)."""
        with self._lock:
            return len(self.slots) - len(self._lost) if self.slots else self.count

    def replace(self, slot: CallSlot) -> bool:
        """``slot``'s call was abandoned (``slot.abandon`` won): its thread is lost, its place in
        the gate goes back, and another thread takes its place. False when ``max_lost`` threads
        are stuck already (none is started)."""
        with self._lock:
            self._lose(slot)
            if self.stopping or len(self.slots) - len(self._lost) >= self.count:
                thread = None  # or its call returned meanwhile and its thread took its own place (_end_lost)
            elif len(self._lost) > self.max_lost:
                thread = False
            else:
                thread = self._new_thread()
        self._let_go()
        if thread:
            thread.start()
        return thread is not False

    def abandon_all(self) -> None:
        """Abandons every call in flight (``CallSlot.abandon``): a stop never waits for one."""
        with self._lock:
            slots = list(self.slots)
        for slot in slots:
            if slot.abandon():
                with self._lock:
                    self._lose(slot)
                self._let_go()

    def _lose(self, slot: CallSlot) -> None:
        """Under ``_lock``, once ``slot.abandon`` won: its thread counts as lost, unless its call
        returned between that abandon and this (the slot's lock is let go first) and the thread
        already ended (``_end_lost``: gone from ``slots``). Counted then, it would stay lost for
        ever: a ghost that ``max_lost``, ``StuckCalls`` and ``serving`` count, never removed."""
        if slot in self.slots:
            self._lost.add(slot)

    def _let_go(self) -> None:
        """An abandoned thread's place in the gate goes back now (the gate outlives this pool);
        the thread, when its job ever returns, does not give it back again (``_work``)."""
        if self._gate is not None:
            self._gate.__exit__()

    def thread_started(self) -> None:
        """On each new thread, before its first job (a subclass's per-thread settings)."""

    def _work(self) -> None:
        self.thread_started()
        me = threading.current_thread()
        with self._lock:
            slot = next(slot for slot in self.slots if slot.thread is me)
        _current.slot = slot
        while True:
            job = self._jobs.get()
            if job is None or self.stopping:
                if job is not None and self._on_dropped is not None:
                    self._on_dropped(job)
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

    def _end_lost(self, slot: CallSlot) -> None:
        """On a lost thread whose call returned at last: it ends, and if fewer than ``count``
        threads serve the queue (``replace`` started none past ``max_lost``), one takes its place
        now. A child's pipeline lives for all epochs: without this its pool would shrink to no
        thread, and the next epoch wait for ever."""
        with self._lock:
            self.slots.remove(slot)
            self._lost.discard(slot)
            serving = len(self.slots) - len(self._lost)
            thread = self._new_thread() if not self.stopping and serving < self.count else None
        if thread is not None:
            thread.start()

    def all_threads(self) -> list[threading.Thread]:
        """Every thread this pool started (an eager pool's starter included) but the lost ones
        (they write nothing more and end when their call returns), for a bounded wait."""
        with self._lock:
            serving = [slot.thread for slot in self.slots if not slot.abandoned]
        return serving if self._starter is None else [self._starter, *serving]

    def stop(self) -> bool:
        """Lets no queued job start (``on_dropped``); each thread ends after the job it runs.
        Does not wait: the caller waits on ``all_threads()`` within its own bound. Safe to call
        again: True the first time only."""
        with self._lock:  # _end_lost and ensure_serving start no thread once this is set
            stopping, self.stopping = self.stopping, True
        if stopping:
            return False
        while self._on_dropped is not None:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                self._on_dropped(job)
        for _ in range(self.count):  # one for each serving thread, started or about to be
            self._jobs.put(None)
        return True


class Call:
    """One blocking call: the job ``BlockingCalls`` queues, and what its caller waits on."""

    __slots__ = ("future", "function", "args", "on_start", "started", "slot")

    def __init__(self, function: Callable[..., Any], args: tuple, on_start: Callable[[], Any] | None) -> None:
        self.future: Future = Future()
        self.function, self.args, self.on_start = function, args, on_start
        self.started: float | None = None  # time.perf_counter() when a thread took it
        self.slot: CallSlot | None = None

    def __call__(self) -> None:
        """On a pool thread: runs the call; its result or error goes to the future unless the
        caller gave up on it meanwhile (then nobody waits for it)."""
        if not self.future.set_running_or_notify_cancel():
            return
        slot = self.slot = current_slot()
        self.started = slot.started = time.perf_counter()
        try:
            if self.on_start is not None:
                self.on_start()
            result = self.function(*self.args)
        except BaseException as error:
            if slot.claim():
                self.future.set_exception(error)
        else:
            if slot.claim():
                self.future.set_result(result)


class BlockingCalls:
    """Calls on ``threads`` threads named ``name``-N (started as calls come), each failing once it
    has run its timeout (see the module). ``timeout_name``: what the user calls the timeout, for
    the message of a call that times out."""

    def __init__(self, threads: int, name: str, timeout_name: str = "timeout") -> None:
        self.pool = AbandoningPool(threads, name, on_dropped=lambda call: call.future.cancel())
        self.timeout_name = timeout_name

    @property
    def max_lost(self) -> int:
        return self.pool.max_lost

    @max_lost.setter
    def max_lost(self, value: int) -> None:
        self.pool.max_lost = value

    def submit(self, function: Callable[..., Any], *args: Any, on_start: Callable[[], Any] | None = None) -> Call:
        """Queues ``function(*args)``; ``on_start`` is called on the thread when it starts."""
        if self.pool.stopping:
            raise RuntimeError("these blocking calls are shut down")
        lost = len(self.pool._lost)  # one look, no copy: this is every local file's read
        if lost >= self.pool.max_lost:
            raise StuckCalls(f"{lost} calls are stuck past {self.timeout_name} and still running, the "
                             f"most this loader starts threads for ({self.pool.max_lost}): "
                             f"the storage or the read hangs; no more calls start until some return")
        call = Call(function, args, on_start)
        self.pool.ensure_serving()
        self.pool.submit(call)
        return call

    def call(self, function: Callable[..., Any], *args: Any, timeout: float) -> Any:
        """``function(*args)`` on a pool thread, for a thread that may block (a decode thread):
        raises ``TimeoutError`` once the call has run ``timeout`` seconds, or has waited
        ``QUEUED_LIMIT`` of them for a thread. One wait on the future in the usual case; the
        start time is looked at only when that wait times out. A ``TimeoutError`` the function
        raises itself (``ETIMEDOUT`` from a soft network mount) is its own error, not the wait's:
        it propagates as it is, at once (the future is done then)."""
        call = self.submit(function, *args)
        queued = time.perf_counter()
        while True:
            try:  # in slices: a shutdown must not leave the caller waiting out a whole timeout
                return call.future.result(min(timeout, SLICE_S))
            except TimeoutError:
                if call.future.done():  # the function's own error (or a result just in): as it is
                    return call.future.result()
                if self.pool.stopping:
                    call.future.cancel()
                    raise RuntimeError("these blocking calls are shut down") from None
                started, now = call.started, time.perf_counter()
                if started is not None and now - started >= timeout:
                    if not self._give_up(call):  # it returned meanwhile
                        return call.future.result()
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
            if call.future.done() or not self._give_up(call):  # the function's own TimeoutError, or a result just in
                return call.future.result()
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

    def _give_up(self, call: Call) -> bool:
        """``call`` ran past its timeout: abandoned, its thread lost and replaced (unless
        ``max_lost`` threads are stuck: then ``submit`` refuses new calls). False if it returned
        first (its result is in the future, or about to be)."""
        slot = call.slot
        if slot is None or not slot.abandon(call.started):
            return False
        self.pool.replace(slot)
        return True

    def shutdown(self, timeout: float) -> bool:
        """Cancels queued calls and waits up to ``timeout`` s for the running ones, but not for
        those already past their timeout (their callers have moved on; their threads end when
        the calls return). True when every thread waited for has ended."""
        self.pool.stop()  # first: no thread starts after it (a call submitted now, a lost one's place)
        workers = self.pool.all_threads()
        deadline = time.monotonic() + timeout
        for thread in workers:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in workers)
