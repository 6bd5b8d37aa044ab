"""How many children ``processes=`` asks for (``process_count``) and, for ``processes=None``, whether
children can be used at all, and how many memory allows.

Both are asked only once the loader's stats say the GIL is the limit, so that a loader that
never needs children never pickles its source or reads ``/proc``. What cannot be used is said
in one line naming the object and what to change, never with a child's traceback.
"""

from __future__ import annotations

import multiprocessing
import pickle
import sys
from typing import Any

import psutil

from ..errors import describe
from ..redact import unpicklable
from . import shm
from .script import script_refusal

CHILD_BYTES_GUESS = 400 * 2**20  # a child's own memory (PSS) before one was measured: torch and the pipeline
RESERVE_SHARE = 0.1  # of the machine's memory, never taken by children: the training process grows too
RESERVE_BYTES = 2**30  # at least this much


def children_blocked(arguments: dict[str, Any]) -> str | None:
    """Why child processes cannot run this loader's pipeline, as one line; None when they can.
    ``arguments``: what a child would get (``source``, ``read``, ``decode``, ...)."""
    no_script = getattr(sys.modules.get("__main__"), "__file__", None) is None
    payload = {}
    for name, value in arguments.items():
        try:
            data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as error:
            what = f"{name}= ({unpicklable(value)})" if isinstance(value, dict) else f"{name}={unpicklable(value)}"
            return (f"{what} does not pickle ({describe(error)}): define it at the top level of a module (not a "
                    f"lambda, a nested function or a local class)")
        if no_script and b"__main__" in data:
            return (f"{name}={unpicklable(value)} is defined in an interactive session's __main__, which a child "
                    f"process cannot import: define it in a module")
        payload[name] = data
    refusal = script_refusal(payload, arguments)
    if refusal is not None:
        return refusal
    if "spawn" not in multiprocessing.get_all_start_methods():
        return "this platform has no 'spawn' start method"
    reason = shm.supported()
    if reason:
        return reason
    return None


def blocked_message(reason: str, count: int) -> str:
    """The one line said when children would help but cannot be used."""
    return (f"asyncload: processes=None stays in this process: Python under one GIL limits this loader and "
            f"{count} child processes would help, but {reason}. Pass processes=0 to keep it in this process "
            f"without this message")


def children_memory_allows(per_child: int, available: int | None = None, total: int | None = None) -> int:
    """How many children fit in the memory available now, keeping ``RESERVE_SHARE`` of the
    machine (at least ``RESERVE_BYTES``) for everything else. The batch buffers are shared
    with the children and already allocated: only a child's own memory counts."""
    memory = psutil.virtual_memory()
    available = memory.available if available is None else available
    total = memory.total if total is None else total
    spare = available - max(RESERVE_BYTES, int(RESERVE_SHARE * total))
    return max(0, spare // max(1, per_child))


def children_pss(pids: list[int]) -> int | None:
    """The children's proportional set size (shared pages split among their users), in bytes;
    None where the platform does not tell."""
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_full_info().pss
        except (psutil.Error, AttributeError, OSError):
            return None
    return total


# ----- how many processes -----
# ``processes=N``: how many children; ``backend.py`` builds them (``parent.py``'s ``ProcessPool``).
#
# Past what one GIL can feed, N child processes each run the read + decode pipeline (their own
# event loop and decode threads) and write samples straight into rows of the same shared-memory
# batch buffers that the parent hands to the user. The parent keeps the epoch: order, cursor,
# failure budget, resume state; children get positions and answer which rows are done. No sample
# is ever pickled. ``isolate=True`` is ``processes=1``: the pipeline out of the training process.
#
# Settings that count threads or reads (``num_threads``, ``io_concurrency``) are totals, split
# evenly among the processes; with ``"auto"`` the tuner runs here, on the merged stats, and sends
# its choices to the children.

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
