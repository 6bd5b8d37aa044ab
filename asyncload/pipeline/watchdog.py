"""What each decode thread is doing, so that a decode that never returns is abandoned, not waited for.
The slot's protocol (``claim``/``abandon``) and the pool that replaces a lost thread are
``io/blocking``'s, shared with the reads' blocking calls; the decode's own are the watchdog below,
the job's place in the slot, and the poison of a buffer a stuck decode may still write.

A thread running user code cannot be stopped. Each decode thread has a ``Slot``: when it starts
a decode it writes the start time there (two attribute stores, no lock), and when the decode
returns it ``claim``s the result under the slot's lock before it writes anything. A watchdog on
the pipeline's event loop looks at the slots a few times a second (``overdue``) and
``abandon``s a decode past ``decode_timeout``, under the same lock: exactly one side wins. If
the watchdog wins, its ``on_timeout`` fails the sample and hands the rest of the job to another
thread, and the stuck thread, when its decode ever returns, drops the result and ends: it never
writes into a buffer that may have been handed out or reused since. ``close`` gives the decodes
in flight a short grace (``DecodeWorkers.wind_down``), then abandons the rest the same way, so a
stop never waits for one long.

A decoder that writes its row itself (``decode_into``: the library's image decoders) may still
write when it returns, whatever the watchdog decided: its job names the buffer in ``writes``,
and abandoning it *poisons* that buffer (``BatchBuffer.poisoned``), which is then never handed
out nor recycled. The driver moves the batch to a fresh buffer (``in_flight.py``), so the
stuck thread only ever writes memory nobody reads. When the abandoned call returns at last, it
writes no more: the poison is lifted (once no other abandoned call writes there) and the ring may
reuse the buffer. A whole batch's decode (``decode_batch``)
is not timed: its rows are written by the call, for the whole batch at once. The read of a plain
local file a decode job does itself is timed the same way (a hard network mount may never
answer; no read thread times it): past ``decode_timeout`` its row fails at stage ``read``.
"""

from __future__ import annotations

import threading
import time
import warnings
from typing import Any, Callable

from ..io.blocking import CallSlot
from ..redact import bounded

WATCH_S = 0.25  # how often the watchdog looks at the slots (a timeout is noticed that much late at most)


class Slot(CallSlot):
    """One decode thread's current decode (``io/blocking.CallSlot``: ``started``, ``abandoned``,
    ``claim``, ``abandon``), what to do if it times out (``on_timeout(slot, cause, submit)``) and
    the job's place. Abandoning one that writes its row itself poisons that buffer, until it returns."""

    __slots__ = ("on_timeout", "work", "rows", "index", "done", "writes", "reading")

    def __init__(self, thread: threading.Thread) -> None:
        super().__init__(thread)
        self.on_timeout: Callable[[Slot, BaseException, Callable[[Any], None]], None] | None = None
        self.work: Any = None  # the job's fill, its rows, the row running and how many were done
        self.rows: Any = None
        self.index = 0
        self.done = 0
        self.writes: Any = None  # the BatchBuffer a decode_into job writes in itself (None: one that returns)
        self.reading = False  # the row's local file is being read (a timeout fails it at stage "read")

    def given_up(self) -> None:
        """The buffer an in-place decode writes is poisoned, before anyone hears of the abandon:
        it may write there whenever it returns, so it is never handed out meanwhile."""
        if self.writes is not None:
            _poison(self.writes)

    def returned_late(self) -> None:
        """The abandoned decode returned: the buffer its ``decode_into`` wrote is not poisoned by
        it any more."""
        if self.writes is not None:
            _unpoison(self.writes)
            self.writes = None


_poison_lock = threading.Lock()  # the count of stuck writers of each poisoned buffer (slots of several threads)
_stuck_writers: dict[int, int] = {}  # id(buffer): abandoned decode_into calls still running (each slot holds it)


def _poison(buffer: Any) -> None:
    with _poison_lock:
        _stuck_writers[id(buffer)] = _stuck_writers.get(id(buffer), 0) + 1
        buffer.poisoned = True


def _unpoison(buffer: Any) -> None:
    """An abandoned ``decode_into`` returned: once none still runs, the buffer is safe again,
    and the ring may hand it out as any other (in this process; a parent keeps its own
    ``Poisoned`` mark of a child's buffer: a child abandons at a stuck decode only)."""
    with _poison_lock:
        left = _stuck_writers.pop(id(buffer), 1) - 1
        if left:
            _stuck_writers[id(buffer)] = left
        else:
            buffer.poisoned = False


def timed_out_error(timeout: float) -> TimeoutError:
    return TimeoutError(f"did not return within decode_timeout={timeout:g} s")


class Watchdog:
    """Looks at ``workers``' slots a few times a second on ``loop`` and abandons every decode
    past ``timeout`` seconds: its ``on_timeout`` fails the sample, and another thread takes the
    stuck one's place. When too many threads are stuck to replace another, ``on_stuck(message)``
    (the pipeline then fails its runs: waiting would be for ever). ``timeout`` None: no watchdog."""

    def __init__(self, loop: Any, workers: Any, timeout: float | None, on_stuck: Callable[[str], None]) -> None:
        self.loop = loop
        self.workers = workers
        self.timeout = timeout
        self.on_stuck = on_stuck
        self.period = WATCH_S if timeout is None else min(WATCH_S, timeout / 4)
        self.failed = False  # a look raised (warned once)

    def start(self) -> None:
        if self.timeout is not None:
            self.loop.call_soon_threadsafe(self._watch)

    def _watch(self) -> None:
        """One look at the slots; the next is scheduled whatever this one raised (an answer sent
        on a broken pipe): a watchdog that ended would leave every later stuck decode hanging."""
        try:
            self._look()
        except Exception as error:
            if not self.failed:  # once: the same cause would repeat at every look
                self.failed = True
                warnings.warn(f"asyncload: the decode watchdog failed to report a stuck decode: "
                              f"{type(error).__name__}: {bounded(str(error))}", RuntimeWarning)
        finally:
            self.loop.call_later(self.period, self._watch)

    def _look(self) -> None:
        timeout, now = self.timeout, time.perf_counter()
        assert timeout is not None
        for slot in list(self.workers.slots):
            started = slot.started
            if started is None or now - started < timeout or not slot.abandon(started):
                continue
            try:
                if not self.workers.replace(slot):
                    self.on_stuck(f"{len(self.workers.lost())} decodes are stuck past decode_timeout={timeout:g} s "
                                  f"and still running, more than this loader replaces threads for "
                                  f"({self.workers.max_lost}): the decode hangs")
            finally:  # the sample fails whatever on_stuck raised
                if slot.on_timeout is not None:
                    slot.on_timeout(slot, timed_out_error(timeout), self.workers.submit)
        if not self.workers.serving():  # every thread stuck, none replaced: a run started since waits for ever
            self.on_stuck(f"every decode thread is stuck past decode_timeout={timeout:g} s and still running "
                          f"({len(self.workers.lost())} of them): the decode hangs")
