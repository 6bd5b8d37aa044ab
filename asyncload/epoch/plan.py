"""The plan of one epoch run: which positions go into which batch, the replacements for skipped
samples, DDP's batch quota, and the failure budget. The driver's (``driver.py``), in this
process whatever the number of processes, kept apart from the code that moves samples.

A batch takes the cursor's next positions; a failed sample either fails its batch or is replaced
by the cursor's next position (with a DDP quota, once the cursor runs out, a repeat from the
start of the order, so that every rank delivers its batches); a run whose every sample fails still ends. With
``drop_last`` and no quota, a rest too short for a batch stays in the cursor, to replace skipped
samples.
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import SampleError, TooManyFailures
from ..order.epoch_size import EpochSize
from ..order.positions import Cursor, Positions
from ..stats.loader_stats import LoaderStats


class EpochPlan:
    """Positions of ``order`` not in ``done``, handed out batch by batch.

    ``skipped``: positions an earlier run of this epoch skipped (a resume): they are not read
    again, not repeated, and count against the failure budget, which spans the epoch.
    ``repeated``: positions an earlier run delivered again to fill the quota: repeats go on past
    them, as the uninterrupted run's would.
    ``size``: the epoch's arithmetic, of which ``batches_done`` batches were handed out before
    (the DDP quota, ``drop_last``). ``epoch`` and ``rank`` go on each failure recorded (``record``)."""

    def __init__(self, order: np.ndarray, done: Positions, size: EpochSize, batches_done: int,
                 skip_errors: bool, max_failures: int | float, stats: LoaderStats,
                 skipped: Positions | None = None, repeated: Positions | None = None, *,
                 epoch: int | None = None, rank: int | None = None) -> None:
        self.order = order
        self.epoch = epoch
        self.rank = rank
        self.size = size
        self.quota = size.quota(batches_done)
        self.batch_size = size.batch_size
        self.keeps_short_rest = size.keeps_short_rest(self.quota)
        self.smallest_batch = size.smallest_batch
        self.skip_errors = skip_errors
        self.max_failures = max_failures
        self.stats = stats
        self._failed: set[int] = set()
        self._earlier_failures = 0
        if skipped is not None and len(skipped):
            self._failed = {p for start, stop in skipped.intervals() for p in range(start, stop)}
            self._earlier_failures = len(self._failed)
            done = Positions([*done.intervals(), *skipped.intervals()])
        self._done = done
        self.cursor = Cursor(len(order), done)
        self.failure_limit = failure_limit(max_failures, len(order))
        self.failures: list[SampleError] = []
        self._repeated = repeated if repeated is not None else Positions()
        self._next_repeat = 0  # the next position to repeat, with a quota

    def undelivered(self) -> np.ndarray:
        """The source indices of the order at positions not done, in order."""
        wanted = np.ones(len(self.order), dtype=bool)
        for start, stop in self._done.intervals():
            wanted[start:stop] = False
        return self.order[wanted]

    def take_batch(self, number: int) -> tuple[list[int], list[int]]:
        """The positions of batch ``number``: the cursor's next ones, filled up to the quota's
        batch size with repeats once the cursor runs short (also returned, as the second list);
        none when the epoch has no batch left."""
        size = self.batch_size
        if self.quota is not None:
            if number >= self.quota.count:
                return [], []
            size = self.quota.last_size if number == self.quota.count - 1 else size
        if self.keeps_short_rest:  # the rest stays, to replace skipped samples
            return self.cursor.take(size, whole=True), []
        positions = self.cursor.take(size)
        repeats = self._repeats(size - len(positions)) if self.quota is not None and len(positions) < size else []
        if len(positions) + len(repeats) < self.smallest_batch:
            return [], repeats
        return positions + repeats, repeats

    def replacement(self) -> tuple[int | None, bool]:
        """The position that takes a skipped sample's row, or None if the epoch has none left;
        and whether it is a repeat (with a quota, from the start once the cursor is exhausted)."""
        taken = self.cursor.take(1)
        if taken:
            return taken[0], False
        repeats = self._repeats(1) if self.quota is not None else []
        return (repeats[0], True) if repeats else (None, False)

    def _repeats(self, count: int) -> list[int]:
        """Up to ``count`` positions repeated from the start of the order, passing over the
        ones that failed and those an earlier run of the epoch repeated; one pass, so a run
        whose samples all fail still ends."""
        taken: list[int] = []
        while len(taken) < count and self._next_repeat < len(self.order):
            position = self._next_repeat
            if position not in self._failed and position not in self._repeated:
                taken.append(position)
            self._next_repeat += 1
        return taken

    def failures_left(self) -> int:
        """Failures the budget still allows this epoch (skipping)."""
        return self.failure_limit - self._earlier_failures - len(self.failures)

    def record(self, position: int, error: SampleError) -> SampleError | None:
        """Counts the failure of the sample at ``position``; returns the error its batch must
        raise, or None to skip the sample. A sample that fails again (a repeat) is
        skipped without counting twice. The error takes this run's epoch and rank."""
        if position in self._failed and self.skip_errors:
            return None
        self._failed.add(position)
        error.epoch, error.rank = self.epoch, self.rank
        self.stats.add_failure(error.item, error.stage, error.cause, error.epoch, error.rank)
        self.failures.append(error)
        if not self.skip_errors:
            return error
        if self._earlier_failures + len(self.failures) > self.failure_limit:
            return TooManyFailures(self.failures, self.max_failures)
        return None


def failure_limit(max_failures: int | float, epoch_size: int) -> int:
    """How many failures an epoch may have: a count, or a fraction of the epoch's samples."""
    if isinstance(max_failures, float):
        return math.floor(max_failures * epoch_size)
    return max_failures
