"""``processes=None``: whether children can be used at all, and how many memory allows.

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
