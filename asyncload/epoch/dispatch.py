"""Which pipeline fills which rows, and the fills each one has in hand.

With one pipeline (in-process) every fill goes to it. With N (``processes=N``) a batch's rows go
to the least busy pipeline, except with tar shards: the run's chunk reads are planned once here
and each chunk is owned by one pipeline, so a row goes to the pipeline that reads its chunk and
a run makes the same reads whatever N. The driver decides what to fill; this only routes it.
"""

from __future__ import annotations

import itertools

import numpy as np

from ..pipeline.messages import Fill, Start
from ..pipeline.pipes import Pipes
from ..sources.shard_plan import plan_reads
from ..sources.shards import ShardSource
from .in_flight import InFlight


class Dispatch:
    """Routes the fills of run ``run`` over ``pipes`` and counts what each pipeline has in hand."""

    def __init__(self, pipes: Pipes, run: int, order: np.ndarray) -> None:
        self.pipes = pipes
        self.run = run
        self.order = order  # epoch position -> source index
        self.owner: np.ndarray | None = None  # source index -> the pipeline that reads it (tar shards)
        self.fills: dict[int, tuple[InFlight, int]] = {}  # fill id -> its batch and pipeline
        self.load = [0] * pipes.count  # fills in hand per pipeline
        self._ids = itertools.count()

    def start(self, epoch: int, source: object, undelivered: np.ndarray) -> None:
        """Starts the run in every pipeline; tar shards: plans the reads of the epoch's
        ``undelivered`` positions and gives each pipeline the chunks it owns."""
        count = self.pipes.count
        if not isinstance(source, ShardSource):
            for index in range(count):
                self.pipes.send(index, Start(self.run, epoch, None))
            return
        reads = plan_reads(source, undelivered)
        for index in range(count):
            self.pipes.send(index, Start(self.run, epoch, reads.owned(index, count)))
        if count > 1:
            self.owner = reads.owner_of(len(source), count)

    def pipe_for(self, index: int) -> int:
        """The pipeline that reads source index ``index`` on its own (the probe's)."""
        return 0 if self.owner is None or self.owner[index] < 0 else int(self.owner[index])

    def send(self, batch: InFlight, rows: list[int]) -> None:
        """Sends ``rows`` of ``batch`` to be filled: each to the pipeline that owns its shard
        chunk, else all to the least busy one; one ``Fill`` per pipeline."""
        indices = self.order[[batch.positions[row] for row in rows]]
        idle = min(range(len(self.load)), key=self.load.__getitem__)
        if self.owner is None:
            groups = {idle: rows}
        else:
            groups = {}
            for row, owner in zip(rows, self.owner[indices].tolist()):
                groups.setdefault(owner if owner >= 0 else idle, []).append(row)
        assert batch.buffer is not None
        for pipe, pipe_rows in groups.items():
            fill = next(self._ids)
            self.fills[fill] = (batch, pipe)
            batch.pending += 1
            self.load[pipe] += 1
            pipe_indices = indices if len(groups) == 1 else self.order[[batch.positions[row] for row in pipe_rows]]
            self.pipes.send(pipe, Fill(self.run, fill, batch.buffer.number, pipe_rows, pipe_indices))

    def answered(self, fill: int) -> InFlight:
        """Fill ``fill`` is done: its batch, one fill fewer in hand."""
        batch, pipe = self.fills.pop(fill)
        batch.pending -= 1
        self.load[pipe] -= 1
        return batch
