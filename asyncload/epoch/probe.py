"""Learning the batch layout before the first buffer exists.

Buffers are preallocated, so the shape and dtype of a sample must be known before any fill
starts. The driver asks a pipeline to load the epoch's next samples one at a time, in the
epoch's order, until one loads: its layout allocates the ring. The pipeline keeps that sample
and writes it when its batch is filled, so it is read and decoded once; a sample that fails is
returned with its error, so its row takes the failure policy when its batch is filled, as it
would have without the probe.
"""

from __future__ import annotations

from typing import Callable, Iterable

import numpy as np

from ..batch.layout import SampleLayout
from ..errors import SampleError
from ..pipeline.messages import Failed, Probe, Probed
from ..pipeline.pipes import Pipes


def probe_layout(pipes: Pipes, run: int, positions: Iterable[int], order: np.ndarray,
                 pipe_for: Callable[[int], int], keep_going: int) -> tuple[SampleLayout | None, dict[int, SampleError]]:
    """Probes ``positions`` (epoch positions, in order) until one sample gives its layout.
    Returns the layout (None when none did) and the positions whose sample failed. Probing ends
    after ``keep_going`` + 1 failures: the failure budget left (0 when errors raise: the first
    failure's batch raises anyway), so a source whose samples all fail stops at its budget.
    ``pipe_for``: which pipeline probes a source index (tar shards: the one that reads it)."""
    failed: dict[int, SampleError] = {}
    for position in positions:
        index = int(order[position])
        pipes.send(pipe_for(index), Probe(run, index))
        answer = pipes.receive(run)
        while not isinstance(answer, Probed):
            if isinstance(answer, Failed):
                raise pipeline_failed(answer)
            answer = pipes.receive(run)
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
