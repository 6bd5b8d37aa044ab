"""A batch in flight: assigned by the driver, its rows being filled, not yet handed out.

The driver keeps one per batch in its window. It records what the policy decided for the
batch's rows as their answers come (failures raised, positions skipped and replaced, holes the
epoch had no replacement for, padding), so the hand-out and the epoch's progress read it from
one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..batch.buffers import BatchBuffer
from ..errors import SampleError


@dataclass
class Batch:
    """A batch being filled: its positions, its buffer, the fills not yet answered."""

    number: int
    positions: list[int]
    buffer: BatchBuffer | None
    pending: int = 0
    errors: dict[int, SampleError] = field(default_factory=dict)
    holes: set[int] = field(default_factory=set)  # skipped rows the epoch had no item left for
    skipped: list[int] = field(default_factory=list)  # positions that failed in its rows and were skipped
    padded: list[int] = field(default_factory=list)  # positions the plan gave it as DDP padding
    settling: int = 0  # rows that failed in the probe, their policy not yet applied
    counted: bool = False  # counted in the stats' batches_ready

    def complete(self) -> bool:
        """Every row is written, failed or a hole, and every failure has taken the policy."""
        return self.pending == 0 and self.settling == 0

    def first_error(self) -> SampleError | None:
        return self.errors[min(self.errors)] if self.errors else None
