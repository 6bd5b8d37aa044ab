"""``processes=N``: how many children; ``backend.py`` builds them (``parent.py``'s ``ProcessPool``).

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
