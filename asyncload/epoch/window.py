"""The driver's decisions over the batches of its window, as logic: fed events (a batch assigned,
a row failed, a batch taken for the hand-out), it says what to do, and touches no thread, queue,
buffer or clock, so that it is tested alone (``tests/test_driver_logic.py``). The driver
(``driver.py``) calls it on the user's thread and carries the decisions out: it sends the rows,
waits for the answers, hands out or gives the buffers back. Only what ``stop()`` (any thread)
also touches, ``batches`` added, failed, looked through (``next_ready``) or taken, is used under
the driver's lock; the rest (``wants_batch``, ``verdict``, the record) is the user's thread's alone.

What it decides: whether another batch may be assigned (at most ``size`` ahead of the user);
what a failed row becomes (its batch raises, or the row takes the epoch's next position, or it
is a hole: the plan's failure budget and replacements, ``plan.py``); which batch the user gets
next (the next in order, or with ``in_order=False`` the first complete one); whether a batch
taken is raised, dropped (empty, or left short by skips under ``drop_last``) or delivered, and
with which positions; and the record of what the user got (``ledger.py``).
"""

from __future__ import annotations

from typing import Literal

from ..batch.buffers import BatchBuffer
from ..errors import SampleError
from .in_flight import InFlight
from .plan import EpochPlan
from .ledger import EpochLedger

Verdict = Literal["raise", "drop", "deliver"]


class Window:
    """The batches assigned and not yet taken for the hand-out (``batches``, by number), over
    ``plan``; ``size``: how many may be ahead of the user; ``ledger``: what was handed out."""

    def __init__(self, plan: EpochPlan, ledger: EpochLedger, size: int, in_order: bool) -> None:
        self.plan = plan
        self.ledger = ledger
        self.size = size
        self.in_order = in_order
        self.batches: dict[int, InFlight] = {}
        self.assigned = 0
        self.taken = 0  # batches handed out, dropped or raised
        self.exhausted = False  # no batch will be assigned any more
        self.drained = False  # exhausted for a switch of backends, not at the epoch's end

    # ----- assigning -----

    def wants_batch(self) -> bool:
        """Whether another batch may be assigned now: the plan is not used up and fewer than
        ``size`` batches are ahead of the user."""
        return not self.exhausted and self.assigned - self.taken < self.size

    def next_positions(self) -> tuple[list[int], list[int]]:
        """The plan's positions for the next batch to assign and those of them that are
        repeats; none (then the window is ``exhausted``) when the epoch has no batch left."""
        positions, repeated = self.plan.take_batch(self.assigned)
        if not positions:
            self.exhausted = True
        return positions, repeated

    def add(self, positions: list[int], buffer: BatchBuffer | None, repeated: list[int] | None = None,
            skipped: list[int] | None = None, error: SampleError | None = None) -> InFlight:
        """Batch ``assigned`` is under way over ``positions`` in ``buffer``; ``skipped``: positions
        skipped before it (learning the layout) that go on its record; ``error``: it carries
        only this error (nothing could be read: it raises when its turn comes)."""
        batch = InFlight(self.assigned, positions, buffer, repeated=repeated or [], skipped=skipped or [])
        if error is not None:
            batch.errors[0] = error
            batch.counted = True
        self.batches[batch.number] = batch
        self.assigned += 1
        return batch

    def drain(self) -> None:
        """No more batches are assigned: the iteration ends after those under way (a switch of
        backends), which are the epoch's last only where the plan was already used up."""
        self.drained = not self.exhausted
        self.exhausted = True

    # ----- answers -----

    def failed(self, batch: InFlight, row: int, error: SampleError) -> bool:
        """The policy for a failed ``row`` of ``batch``: the batch raises (``errors``), or the row
        takes the epoch's next position (True: send the row again), or, none left, becomes one
        of its ``holes``."""
        failure = self.plan.record(batch.positions[row], error)
        if failure is not None:
            batch.errors[row] = failure
            return False
        batch.skipped.append(batch.positions[row])
        replacement, repeat = self.plan.replacement()
        if replacement is None:
            batch.holes.add(row)
            return False
        if repeat:
            batch.repeated.append(replacement)
        batch.positions[row] = replacement
        return True

    # ----- the hand-out -----

    def ready(self, number: int) -> bool:
        """Batch ``number`` is assigned, not taken, and complete (its rows all answered)."""
        return (batch := self.batches.get(number)) is not None and batch.complete()

    def next_ready(self) -> int | None:
        """The number of the batch the user gets now, if it is complete: the next in order, or
        with ``in_order=False`` the first complete one, whichever was assigned first."""
        if self.in_order:
            return self.taken if self.ready(self.taken) else None  # in order, batch n is the n-th taken
        return next((number for number in self.batches if self.ready(number)), None)

    def take(self, number: int) -> InFlight:
        """Batch ``number`` leaves the window for the hand-out."""
        batch = self.batches.pop(number)
        self.taken += 1
        return batch

    @property
    def finished(self) -> bool:
        """No batch is under way and none will be assigned: the iteration is over."""
        return self.exhausted and self.taken >= self.assigned

    @property
    def at_end(self) -> bool:
        """The epoch's plan is used up and no batch is under way (not after a ``drain``)."""
        return self.finished and not self.drained

    def verdict(self, batch: InFlight) -> tuple[Verdict, list[int]]:
        """What becomes of a batch taken: ``raise`` its first error; ``drop`` it (a batch is
        never empty; with ``drop_last`` one that skips left short is dropped too); or
        ``deliver`` it, with the positions of its rows that are not holes, in row order."""
        if batch.errors:
            return "raise", []
        delivered = [p for row, p in enumerate(batch.positions) if row not in batch.holes]
        if batch.holes and (not delivered or self.plan.keeps_short_rest):
            return "drop", []
        return "deliver", delivered

    def handed_out(self, batch: InFlight, delivered: list[int]) -> None:
        """The user got ``delivered`` of ``batch``: on the record (``state_dict()``)."""
        self.ledger.handed_out(delivered, batch.skipped, batch.repeated)
        self.ledger.batches += 1

    def dropped(self, batch: InFlight) -> None:
        """``batch`` is not delivered: its skips and repeats stay on the record."""
        self.ledger.handed_out((), batch.skipped, batch.repeated)
