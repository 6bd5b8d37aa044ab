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

import torch

from ..run.settings import Settings
from .merged import ProcessStats
from .parent import ProcessPool



def process_count(processes: int | str | None, isolate: bool) -> int:
    """How many child processes to start with: 0 for in-process (with None, the loader may move to
    children later: ``switch.py``). ``"auto"`` is the default's old name: the same as None."""
    if processes in (None, 0, "auto"):
        return 1 if isolate else 0
    if isolate and processes != 1:
        raise ValueError(f"isolate=True is processes=1; got processes={processes!r} as well")
    if not isinstance(processes, int) or isinstance(processes, bool) or processes < 0:
        raise ValueError(f"processes must be None, a non-negative integer or 'auto', got {processes!r}")
    return processes


def start_processes(count: int, settings: Settings, device: torch.device | None, thread_limit: int | None,
                    threads: int) -> ProcessPool:
    """``count`` children, each running the pipeline on its share of the threads and reads, and
    the merged stats (which become ``settings.stats``: the driver counts there)."""
    pool = build_pool(count, settings, device, thread_limit, threads)
    settings.stats = pool.stats
    return pool


def build_pool(count: int, settings: Settings, device: torch.device | None, thread_limit: int | None,
               threads: int) -> ProcessPool:
    """``start_processes`` without touching ``settings``: the pool and its merged stats
    (``pool.stats``, the tracer carried into it), for a loader still running in this process
    while the children start (``processes=None``)."""
    stats = ProcessStats(settings.io_concurrency, threads, settings.prefetch, count)
    stats.tracer = settings.stats.tracer  # the children's events are merged into it as they arrive
    arguments = vars(settings.pipeline(count, thread_limit))
    pool = ProcessPool(count, arguments, stats, keep=window(settings.prefetch, count) + 2, device=device)
    if settings.ring.layout is not None:  # a decoder that declares its output, or a layout learnt
        pool.ring.configure(settings.ring.layout, settings.ring.capacity)
    return pool


def window(prefetch: int, processes: int) -> int:
    """Batches the driver keeps under way: ``prefetch``, and with processes enough that every
    child has a batch queued behind its current one."""
    return max(prefetch, 2 * processes)
