"""``processes=N``: what ``AsyncLoader`` creates and calls; the rest of ``procs/`` is behind it.

Past what one GIL can feed, N child processes each run the read + decode pipeline (their own
event loop and decode threads) and write samples straight into rows of the same shared-memory
batch buffers that the parent hands to the user. The parent keeps the epoch: order, cursor,
failure budget, resume state; children get positions and answer which rows are done. No sample
is ever pickled. ``isolate=True`` is ``processes=1``: the pipeline out of the training process.

Settings that count threads or reads (``num_threads``, ``io_concurrency``) are totals, split
evenly among the processes; with ``"auto"`` the tuner runs here, on the merged stats, and sends
its choices to the children.
"""

from __future__ import annotations

import math
import numpy as np
import torch

from ..autotune import MAX_IO, AutoTuner, Knob
from ..order.positions import Positions
from ..run.settings import BatchQuota, Settings
from ..stats.machine import usable_cores
from .merged import ProcessStats
from .parent import ProcessPool
from .protocol import Limits
from .run import ProcessRun

CORES_PER_PROCESS = 3  # "auto": the 16-core measurements put the best at one process per 2-4 cores


def process_count(processes: int | str | None, isolate: bool) -> int:
    """How many child processes: 0 for in-process."""
    if processes in (None, 0):
        return 1 if isolate else 0
    if isolate and processes != 1:
        raise ValueError(f"isolate=True is processes=1; got processes={processes!r} as well")
    if processes == "auto":
        return max(1, usable_cores() // CORES_PER_PROCESS)
    if not isinstance(processes, int) or isinstance(processes, bool) or processes < 0:
        raise ValueError(f"processes must be None, a non-negative integer or 'auto', got {processes!r}")
    return processes


class Processes:
    """The children of one loader, its merged stats and (with "auto" settings) its tuner."""

    def __init__(self, count: int, settings: Settings, device: torch.device | None, auto_threads: bool,
                 auto_io: bool, threads: int) -> None:
        self.count = count
        self.settings = settings
        self.window = max(settings.prefetch, 2 * count)  # every child has a batch queued behind its current one
        self.stats = ProcessStats(settings.io_concurrency, threads, settings.prefetch, count)
        settings.stats = self.stats
        arguments = dict(
            source=settings.source, read=settings.read, decode=settings.decode, labelled=settings.labelled,
            num_threads=_share(settings.num_threads, count), io_concurrency=_share(settings.io_concurrency, count),
            thread_limit=_share(threads, count) if auto_threads else None,
            storage_options=settings.storage_options, read_timeout=settings.read_timeout,
            read_retries=settings.read_retries,
        )
        self.pool = ProcessPool(count, arguments, self.stats, keep=self.window + 2, device=device)
        if settings.ring.layout is not None:  # a decoder that declares its output
            self.pool.ring.configure(settings.ring.layout, settings.ring.capacity)
        self.tuner = self._make_tuner(auto_threads, auto_io, threads, settings.num_threads)

    def run(self, epoch: int, order: np.ndarray, done: Positions, quota: BatchQuota | None) -> ProcessRun:
        return ProcessRun(self.pool, self.settings, epoch, order, done, quota, self.window)

    def _make_tuner(self, auto_threads: bool, auto_io: bool, threads: int, most_threads: int) -> AutoTuner | None:
        """The in-process tuner on the merged stats; its knobs count totals over the children."""
        if not (auto_threads or auto_io):
            return None
        pool, count = self.pool, self.count

        def set_threads(value: int) -> None:
            pool.broadcast(Limits(_share(value, count), None))

        def set_io(value: int) -> None:
            pool.broadcast(Limits(None, _share(value, count)))

        io = self.settings.io_concurrency
        thread_knob = Knob("num_threads", threads, count, most_threads, apply=set_threads) if auto_threads else None
        io_knob = Knob("io_concurrency", io, count, MAX_IO, apply=set_io) if auto_io else None
        return AutoTuner(self.stats, thread_knob, io_knob)

    def close(self) -> None:
        self.pool.close()


def _share(total: int, count: int) -> int:
    """One process's part of a total (rounded up: none gets zero)."""
    return max(1, math.ceil(total / count))
