"""One iteration with child processes: assigns whole batches to children, hands them out.

The parent plans with the in-process run's ``EpochPlan`` and hands out with its ``HandOut``; each batch is one shared segment, sent to the least busy child
as one ``Fill`` (rows and source indices) within a window of batches ahead of the user. The
child answers ``Done`` with the rows that failed; with ``on_error="skip"`` their replacements
go to the same child, so when nothing fails the batches are exactly the in-process ones, in
the same order. With a CUDA device, batch k+1's copy starts when batch k is handed out, if k+1
is complete by then, as in-process.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from ..batch.buffers import BatchBuffer
from ..errors import SampleError
from ..order.positions import Positions
from ..run.board import ENDED
from ..run.handout import HandOut
from ..run.plan import EpochPlan
from ..run.settings import BatchQuota, Settings
from .parent import ProcessPool
from .protocol import Done, Fill, Probe, Probed


@dataclass
class Batch:
    """A batch being filled: its positions, its segment, which child fills it."""

    number: int
    positions: list[int]
    segment: int
    buffer: BatchBuffer | None
    child: int
    pending: int = 0  # fills sent and not yet done
    errors: dict[int, SampleError] = field(default_factory=dict)
    holes: set[int] = field(default_factory=set)

    def first_error(self) -> SampleError | None:
        return self.errors[min(self.errors)] if self.errors else None


class ProcessRun:
    """Yields ``(epoch positions, batch)`` as ``EpochRun`` does, so ``AsyncLoader`` treats
    both alike; iterate it on the user's thread."""

    def __init__(self, pool: ProcessPool, settings: Settings, epoch: int, order: np.ndarray, done: Positions,
                 quota: BatchQuota | None, window: int) -> None:
        self.pool = pool
        self.s = settings
        self.epoch = epoch
        self.order = order
        self.window = window
        self.run = pool.new_run()
        self.plan = EpochPlan(order, done, quota, settings.batch_size, settings.drop_last, settings.skip_errors,
                              settings.max_failures, settings.stats)
        self.batches: dict[int, Batch] = {}  # assigned and not yet handed out
        self.fills: dict[int, Batch] = {}
        self.load = [0] * len(pool.conns)  # fills in progress per child
        self._fill_ids = itertools.count()
        self.assigned = 0
        self.handed_out = 0
        self.exhausted = False
        self.handout = HandOut(settings)
        self.pending_copies = self.handout.pending_copies  # the same dict: batch number -> its copy
        self._stopped = False
        settings.stats.run_started()
        if pool.ring.layout is not None:
            self._assign()  # work starts at iter(), as in-process

    # ----- planning -----

    def _assign(self) -> None:
        """Sends new batches to the children while fewer than ``window`` are ahead of the user."""
        while not self.exhausted and self.assigned - self.handed_out < self.window:
            positions = self.plan.take_batch(self.assigned)
            if positions and self.pool.ring.layout is None:
                positions = self._learn_layout(positions)
            if not positions:
                self.exhausted = True
                return
            if self.pool.ring.layout is None:  # the first sample failed the batch
                return
            segment, buffer = self.pool.ring.take()
            child = min(range(len(self.load)), key=self.load.__getitem__)
            batch = Batch(self.assigned, positions, segment, buffer, child)
            self.batches[batch.number] = batch
            self.assigned += 1
            self._send_fill(batch, list(range(len(positions))))

    def _send_fill(self, batch: Batch, rows: list[int]) -> None:
        fill = next(self._fill_ids)
        indices = self.order[[batch.positions[row] for row in rows]]
        self.fills[fill] = batch
        batch.pending += 1
        self.load[batch.child] += 1
        self.pool.send(batch.child, Fill(self.run, fill, batch.segment, rows, indices, self.epoch))

    def _learn_layout(self, positions: list[int]) -> list[int]:
        """Asks a child for the first sample's layout, to allocate segments; a sample that fails
        is skipped (replaced) or fails the first batch, as in-process."""
        while positions:
            self.pool.send(0, Probe(self.run, int(self.order[positions[0]]), self.epoch))
            answer = self._receive()
            assert isinstance(answer, Probed)
            if answer.layout is not None:
                self.pool.ring.configure(answer.layout, self.s.batch_size)
                return positions
            assert answer.error is not None
            failure = self.plan.record(positions[0], answer.error)
            if failure is not None:
                batch = Batch(self.assigned, positions, -1, None, 0, errors={0: failure})
                self.batches[batch.number] = batch
                self.assigned += 1
                self.exhausted = True
                return positions
            replacement = self.plan.replacement()
            positions = [replacement, *positions[1:]] if replacement is not None else positions[1:]
        return positions

    # ----- the children's answers -----

    def _receive(self) -> Any:
        return self.pool.receive(self.run)

    def _done(self, message: Done) -> None:
        if self._stopped:  # stop() from another thread (close()) while this one waited
            raise RuntimeError(ENDED)
        batch = self.fills.pop(message.fill)
        batch.pending -= 1
        self.load[batch.child] -= 1
        for row, error in message.failures:
            failure = self.plan.record(batch.positions[row], error)
            if failure is not None:
                batch.errors[row] = failure
                continue
            replacement = self.plan.replacement()
            if replacement is None:
                batch.holes.add(row)
            else:
                batch.positions[row] = replacement
                self._send_fill(batch, [row])
        if batch.pending == 0:
            self.s.stats.level("batches_ready", 1)

    def _take_answers(self) -> None:
        """Takes in the answers that have arrived, without waiting."""
        while True:
            message = self.pool.receive(self.run, block=False)
            if message is None:
                return
            if isinstance(message, Done):
                self._done(message)

    def _ready(self, number: int) -> bool:
        batch = self.batches.get(number)
        return batch is not None and batch.pending == 0

    # ----- the user's thread -----

    def __iter__(self) -> Iterator[tuple[list[int], Any]]:
        number = 0
        while True:
            if self._stopped:
                raise RuntimeError(ENDED)
            self._assign()
            batch = self._wait_for(number if self.s.in_order else None)
            if batch is None:
                return
            error = batch.first_error()
            if error is not None:
                if batch.buffer is not None:  # complete (no child writes it): the ring may reuse it
                    batch.buffer.give_back()
                raise error
            assert batch.buffer is not None
            out = self.handout.hand_out(batch.number, batch.buffer, len(batch.positions), batch.holes)
            self.handed_out += 1
            number += 1
            self._assign()
            if self.s.device_stage is not None:
                self._take_answers()  # so that batch k+1, if done, is copied now
            self._prefetch_copy(number)
            try:
                yield [p for row, p in enumerate(batch.positions) if row not in batch.holes], out
            finally:
                del out
                self.handout.release()  # the user asked for the next batch, or ended the loop

    def _wait_for(self, number: int | None) -> Batch | None:
        started = time.perf_counter()
        while True:
            ready = number if number is not None else next((n for n in self.batches if self._ready(n)), None)
            if ready is not None and self._ready(ready):
                batch = self.batches.pop(ready)
                if batch.buffer is not None:
                    self.s.stats.level("batches_ready", -1)
                break
            if self.exhausted and self.handed_out >= self.assigned:
                return None
            message = self._receive()
            if isinstance(message, Done):
                self._done(message)
        self.s.stats.add_batch(len(batch.positions) - len(batch.holes), time.perf_counter() - started)
        return batch

    def _prefetch_copy(self, number: int) -> None:
        """With a device stage: if batch ``number`` is complete, start its copy now."""
        if not self.handout.wants_copy(number):
            return
        batch = self.batches.get(number)
        if batch is not None and batch.pending == 0 and not batch.errors and not batch.holes:
            assert batch.buffer is not None
            self.handout.prefetch_copy(number, batch.buffer, len(batch.positions))

    def stop(self) -> None:
        """Ends the run: complete batches go back to the ring now, the others once every child
        has confirmed it writes them no more. Safe to call more than once."""
        if self._stopped:
            return
        self._stopped = True
        self.handout.release()
        unfinished = []
        for batch in self.batches.values():
            if batch.buffer is None or batch.number in self.pending_copies:
                continue
            if batch.pending:
                unfinished.append(batch.buffer)
            else:
                batch.buffer.give_back()
                self.s.stats.level("batches_ready", -1)
        self.batches.clear()
        self.fills.clear()
        self.pending_copies.clear()
        self.pool.stop_run(self.run, unfinished)
        self.s.stats.run_stopped()
