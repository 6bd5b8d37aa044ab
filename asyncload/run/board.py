"""Complete batches, between the threads that finish them (the event loop, decode threads) and
the user's thread that takes them in order.

One condition guards the board; it is touched once per batch (or per failure), never per sample.
"""

from __future__ import annotations

import threading

from ..stats.figures import LoaderStats
from .jobs import Batch

ENDED = "this iteration has ended: the loader was closed or iterated anew"


class Board:
    """Batches complete and not yet taken, how many the run will make, and how it ended."""

    def __init__(self, stats: LoaderStats) -> None:
        self.stats = stats
        self._cond = threading.Condition()
        self._finished: dict[int, Batch] = {}
        self._count: int | None = None  # batches of the run, known once the plan is exhausted
        self._completed = 0  # batches complete (every row done or failed)
        self.handed_out = 0  # batches the user took (or dropped); written by the user's thread only
        self.stopped = False  # no batch is handed out any more
        self._loop_ended = False
        self._fatal: BaseException | None = None

    def finish(self, batch: Batch) -> bool:
        """``batch`` is complete; True when it was the run's last."""
        self.stats.level("batches_ready", 1)
        with self._cond:
            self._finished[batch.number] = batch
            self._completed += 1
            last = self._count is not None and self._completed >= self._count
            self._cond.notify_all()
        return last

    def planned(self, count: int) -> bool:
        """The run makes ``count`` batches; True when all are complete already."""
        with self._cond:
            self._count = count
            self._cond.notify_all()
            return self._completed >= count

    def loop_ended(self, fatal: BaseException | None) -> None:
        """The event loop has ended (``fatal``: why, when it was not asked to)."""
        with self._cond:
            self._fatal = fatal
            self._loop_ended = True
            self._cond.notify_all()

    def take(self, number: int | None) -> Batch | None:
        """Blocks until batch ``number`` (or, with None, any batch) is complete and takes it;
        None once the run has no more batches."""
        with self._cond:
            while True:
                ready = number if number is not None else next(iter(self._finished), None)
                if ready in self._finished:
                    batch = self._finished.pop(ready)
                    self.stats.level("batches_ready", -1)
                    return batch
                if self._count is not None and self.handed_out >= self._count:
                    return None
                if self.stopped:
                    raise RuntimeError(ENDED)
                if self._loop_ended:
                    raise RuntimeError("the loader's event loop stopped unexpectedly") from self._fatal
                self._cond.wait()

    def peek(self, number: int) -> Batch | None:
        """Batch ``number`` if it is complete, without taking it."""
        with self._cond:
            return self._finished.get(number)

    def clear(self) -> None:
        """Forgets the batches not taken (the run is stopped)."""
        self.stats.level("batches_ready", -len(self._finished))
        self._finished.clear()
