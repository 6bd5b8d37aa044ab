"""A batch in flight: assigned by the driver, its rows being filled, not yet handed out.

The driver keeps one per batch in its window. It records what the policy decided for the
batch's rows as their answers come (failures raised, positions skipped and replaced, holes the
epoch had no replacement for, repeats to fill the DDP quota), so the hand-out and the epoch's progress read it from
one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..batch.buffers import BatchBuffer
from ..errors import SampleError


@dataclass
class InFlight:
    """A batch being filled: its positions, its buffer, the fills not yet answered."""

    number: int  # the batch number in the epoch
    positions: list[int]
    buffer: BatchBuffer | None
    pending: int = 0
    errors: dict[int, SampleError] = field(default_factory=dict)
    holes: set[int] = field(default_factory=set)  # skipped rows the epoch had no item left for
    skipped: list[int] = field(default_factory=list)  # positions that failed in its rows and were skipped
    repeated: list[int] = field(default_factory=list)  # positions the plan repeated into it to fill the DDP quota
    settling: int = 0  # rows that failed in the probe, their policy not yet applied
    counted: bool = False  # counted in the stats' batches_ready
    moved: dict[int, BatchBuffer] = field(default_factory=dict)  # rows left in a poisoned buffer: where

    def complete(self) -> bool:
        """Every row is written, failed or a hole, and every failure has taken the policy."""
        return self.pending == 0 and self.settling == 0

    def first_error(self) -> SampleError | None:
        return self.errors[min(self.errors)] if self.errors else None

    def leave_if_poisoned(self, take: Callable[[], BatchBuffer]) -> None:
        """If the batch's buffer is poisoned (an abandoned ``decode_into`` may write it at any
        time, ``pipeline/watchdog.py``): rows sent from now on go to a fresh one (``take()``); those
        written or being written in the old one stay there until ``gather``. Rare: then one
        batch's copy."""
        if self.buffer is None or not self.buffer.poisoned:
            return
        fresh = take()
        for row in range(len(self.positions)):
            self.moved.setdefault(row, self.buffer)  # a row moved before stays where it is
        self.buffer = fresh

    def sending(self, rows: list[int]) -> None:
        """``rows`` are sent to be filled again (replacements): into the current buffer."""
        for row in rows:
            self.moved.pop(row, None)

    def gather(self) -> None:
        """Once complete: copies the rows left in poisoned buffers into the current one. The
        stuck decode's own row is not among them (it failed: replaced, a hole or raised), so
        whatever it writes later is never read."""
        assert self.buffer is not None
        by_buffer: dict[int, tuple[BatchBuffer, list[int]]] = {}
        for row, old in self.moved.items():
            by_buffer.setdefault(id(old), (old, []))[1].append(row)
        for old, rows in by_buffer.values():
            for target, source in zip(self.buffer.arrays, old.arrays):
                if target is not None and source is not None:
                    target[rows] = source[rows]
        self.moved.clear()
