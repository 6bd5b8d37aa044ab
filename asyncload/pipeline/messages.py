"""What the driver and a pipeline say to each other, the same in this process and across a pipe.

Only control data: which run, which batch buffer (by number), which rows, which source indices,
which rows failed. Samples never travel: a pipeline writes them into the buffer's rows. A batch
costs one ``Fill`` out and one ``Done`` back per pipeline that fills rows of it, whatever its size
(its indices travel as one NumPy array). ``procs/protocol.py`` adds what only processes need.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..batch.layout import SampleLayout
from ..errors import SampleError
from ..sources.shard_plan import ChunkPlan

# ----- driver -> pipeline -----


@dataclass
class Start:
    """Run ``run`` of epoch ``epoch`` begins; ``chunks``: the shard reads this pipeline owns."""

    run: int
    epoch: int
    chunks: ChunkPlan | None


@dataclass
class Fill:
    """Write the samples ``indices`` (source indices) into ``rows`` of buffer ``segment``;
    answer with one ``Done`` for ``fill`` once every row succeeded or failed."""

    run: int
    fill: int
    segment: int
    rows: list[int]
    indices: np.ndarray


@dataclass
class Probe:
    """Load the sample at source index ``index`` and answer with its layout (``Probed``): buffers
    cannot be allocated before the first sample's shape is known. The pipeline keeps the sample
    and writes it when a ``Fill`` of the run names it, so it is read and decoded once."""

    run: int
    index: int


@dataclass
class Stop:
    """Run ``run`` is over: drop its queued work and answer ``Stopped`` once none is running,
    so the driver knows the buffers it used are written no more."""

    run: int


# ----- pipeline -> driver -----


@dataclass
class Done:
    """Fill ``fill`` of run ``run`` is complete; ``failures`` are its rows that failed."""

    run: int
    fill: int
    failures: list[tuple[int, SampleError]]
    figures: dict[str, Any] | None = None  # a child's stats and trace events ride along (procs/)
    trace: Any = None
    side: dict[tuple[int, int], Any] | None = None  # what its rows put aside (batch/ragged.py)


@dataclass
class Poisoned:
    """An abandoned in-place decode of run ``run`` may still write buffer ``segment`` (sent
    before its row's failure): the buffer is never handed out or reused again (``watchdog.py``)."""

    run: int
    segment: int
    figures: dict[str, Any] | None = None
    trace: Any = None


@dataclass
class Probed:
    """The answer to ``Probe``: the layout of the labelled sample, or the ``SampleError``."""

    run: int
    layout: SampleLayout | None
    error: SampleError | None
    figures: dict[str, Any] | None = None
    trace: Any = None


@dataclass
class Failed:
    """A task of run ``run`` raised what no row owns (a bug, a broken setting): the run cannot
    complete, and the driver raises rather than wait for it."""

    run: int
    error: BaseException
    figures: dict[str, Any] | None = None
    trace: Any = None


@dataclass
class Stopped:
    run: int
    figures: dict[str, Any] | None = None
    trace: Any = None
