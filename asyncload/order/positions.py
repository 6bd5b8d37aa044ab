"""Which positions of an epoch's order are done, kept as a few intervals, and the cursor that
hands out the rest.

Resuming needs to know what was delivered. Batches take consecutive positions, so what was
delivered is almost always one interval ``[0, n)``; a skipped sample's replacement or an
out-of-order batch adds a few more. The state stays a handful of numbers, never a per-sample list.
"""

from __future__ import annotations

import bisect
from typing import Iterable


class Positions:
    """A set of non-negative integers stored as sorted, disjoint, non-touching ``[start, stop)``."""

    def __init__(self, intervals: Iterable[Iterable[int]] = ()) -> None:
        self._starts: list[int] = []
        self._stops: list[int] = []
        for start, stop in intervals:
            self.add_interval(start, stop)

    def add(self, positions: Iterable[int]) -> None:
        """Adds positions, as runs of consecutive values."""
        run_start = run_stop = None
        for position in sorted(positions):
            if run_stop == position:
                run_stop += 1
                continue
            if run_start is not None:
                self.add_interval(run_start, run_stop)
            run_start, run_stop = position, position + 1
        if run_start is not None:
            self.add_interval(run_start, run_stop)

    def add_interval(self, start: int, stop: int) -> None:
        if start >= stop:
            return
        first = bisect.bisect_left(self._stops, start)  # first interval that ends at or after start
        last = bisect.bisect_right(self._starts, stop)  # intervals from here on start after stop
        if first < last:
            start = min(start, self._starts[first])
            stop = max(stop, self._stops[last - 1])
        self._starts[first:last] = [start]
        self._stops[first:last] = [stop]

    def __contains__(self, position: int) -> bool:
        index = bisect.bisect_right(self._starts, position) - 1
        return index >= 0 and position < self._stops[index]

    def __len__(self) -> int:
        return sum(stop - start for start, stop in zip(self._starts, self._stops))

    def intervals(self) -> list[list[int]]:
        return [[start, stop] for start, stop in zip(self._starts, self._stops)]

    def __repr__(self) -> str:
        return f"Positions({self.intervals()})"


class Cursor:
    """Hands out the positions ``[0, total)`` that are not in ``skip``, in increasing order."""

    def __init__(self, total: int, skip: Positions) -> None:
        self.total = total
        self._skip = skip.intervals()
        self._next = 0
        self._interval = 0

    def peek(self, count: int) -> list[int]:
        """The next ``count`` positions ``take`` would give, without taking them."""
        saved = self._next, self._interval
        try:
            return self.take(count)
        finally:
            self._next, self._interval = saved

    def take(self, count: int, whole: bool = False) -> list[int]:
        """Up to ``count`` next positions (fewer at the end, none once exhausted). ``whole``:
        ``count`` or none, leaving a shorter rest in place (``drop_last`` keeps it to replace
        skipped samples)."""
        if whole:
            saved = self._next, self._interval
            taken = self.take(count)
            if len(taken) < count:
                self._next, self._interval = saved
                return []
            return taken
        taken: list[int] = []
        while len(taken) < count and self._next < self.total:
            while self._interval < len(self._skip) and self._skip[self._interval][1] <= self._next:
                self._interval += 1
            if self._interval < len(self._skip) and self._skip[self._interval][0] <= self._next:
                self._next = self._skip[self._interval][1]
                continue
            stop = self.total
            if self._interval < len(self._skip):
                stop = min(stop, self._skip[self._interval][0])
            end = min(stop, self._next + count - len(taken))
            taken.extend(range(self._next, end))
            self._next = end
        return taken
