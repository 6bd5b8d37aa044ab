"""Which pipeline fills which rows, and the fills each one has in hand.

With one pipeline (in-process) every fill goes to it. With N (``processes=N``) a batch's rows go
to the least busy pipeline, except with tar shards: the run's chunk reads are planned once here
and each chunk is owned by one pipeline, so a row goes to the pipeline that reads its chunk and
a run makes the same reads whatever N. The driver decides what to fill; this only routes it.
Before the first buffer exists, the probe of the first samples that teaches the ring its layout
is routed here as well (``probe_layout``).
"""

from __future__ import annotations

import itertools
from typing import Callable, Iterable

import numpy as np

from ..batch.layout import SampleLayout
from ..errors import SampleError
from ..pipeline.messages import Failed, Fill, Probe, Probed, Start
from ..pipeline.pipelines import Pipelines
from ..sources.shard_plan import plan_reads
from ..sources.shards import ShardSource
from .in_flight import InFlight


class Dispatch:
    """Routes the fills of run ``run`` over ``pipelines`` and counts what each pipeline has in hand."""

    def __init__(self, pipelines: Pipelines, run: int, order: np.ndarray) -> None:
        self.pipelines = pipelines
        self.run = run
        self.order = order  # epoch position -> source index
        self.owner: np.ndarray | None = None  # source index -> the pipeline that reads it (tar shards)
        self.fills: dict[int, tuple[InFlight, int]] = {}  # fill id -> its batch and pipeline
        self.load = [0] * pipelines.count  # fills in hand per pipeline
        self._ids = itertools.count()

    def start(self, epoch: int, source: object, undelivered: np.ndarray) -> None:
        """Starts the run in every pipeline; tar shards: plans the reads of the epoch's
        ``undelivered`` positions and gives each pipeline the chunks it owns."""
        count = self.pipelines.count
        if not isinstance(source, ShardSource):
            for index in range(count):
                self.pipelines.send(index, Start(self.run, epoch, None))
            return
        reads = plan_reads(source, undelivered)
        for index in range(count):
            self.pipelines.send(index, Start(self.run, epoch, reads.owned(index, count)))
        if count > 1:
            self.owner = reads.owner_of(len(source), count)

    def pipeline_for(self, index: int) -> int:
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
        for pipeline, pipeline_rows in groups.items():
            fill = next(self._ids)
            self.fills[fill] = (batch, pipeline)
            batch.pending += 1
            self.load[pipeline] += 1
            pipeline_indices = (indices if len(groups) == 1
                                else self.order[[batch.positions[row] for row in pipeline_rows]])
            self.pipelines.send(pipeline, Fill(self.run, fill, batch.buffer.slot, pipeline_rows, pipeline_indices))

    def answered(self, fill: int) -> InFlight:
        """Fill ``fill`` is done: its batch, one fill fewer in hand."""
        batch, pipeline = self.fills.pop(fill)
        batch.pending -= 1
        self.load[pipeline] -= 1
        return batch


# ----- the first sample's layout -----
# Learning the batch layout before the first buffer exists.
#
# Buffers are preallocated, so the shape and dtype of a sample must be known before any fill
# starts. The driver asks a pipeline to load the epoch's next samples one at a time, in the
# epoch's order, until one loads: its layout allocates the ring. The pipeline keeps that sample
# and writes it when its batch is filled, so it is read and decoded once; a sample that fails is
# returned with its error, so its row takes the failure policy when its batch is filled, as it
# would have without the probe.

def probe_layout(pipelines: Pipelines, run: int, positions: Iterable[int], order: np.ndarray,
                 pipeline_for: Callable[[int], int],
                 keep_going: int) -> tuple[SampleLayout | None, dict[int, SampleError]]:
    """Probes ``positions`` (epoch positions, in order) until one sample gives its layout.
    Returns the layout (None when none did) and the positions whose sample failed. Probing ends
    after ``keep_going`` + 1 failures: the failure budget left (0 when errors raise: the first
    failure's batch raises anyway), so a source whose samples all fail stops at its budget.
    ``pipeline_for``: which pipeline probes a source index (tar shards: the one that reads it)."""
    failed: dict[int, SampleError] = {}
    for position in positions:
        index = int(order[position])
        pipelines.send(pipeline_for(index), Probe(run, index))
        answer = pipelines.receive(run)
        while not isinstance(answer, Probed):
            if isinstance(answer, Failed):
                raise pipeline_failed(answer)
            answer = pipelines.receive(run)
        if answer.layout is not None:
            return answer.layout, failed
        assert answer.error is not None
        failed[position] = answer.error
        if len(failed) > keep_going:
            break
    return None, failed


def pipeline_failed(message: Failed) -> RuntimeError:
    """The error the user's loop gets when a pipeline task failed outside any sample."""
    error = RuntimeError(f"the loader's pipeline failed: {type(message.error).__name__}: {message.error}")
    error.__cause__ = message.error
    return error
