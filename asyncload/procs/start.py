"""How children are started: from multiprocessing's fork server, preloaded with the child's
modules, where the platform has one; with ``spawn`` elsewhere.

Why not ``spawn`` alone: a spawned child imports torch and the pipeline itself, about 2 s of
CPU each on the 2-core box (measured: ``python -X importtime -c "import asyncload.procs.child"``,
torch is 1.5 s of it), so N children cost N imports, at once, on the cores the loader needs,
and ``processes=None`` waited that long before its switch. The fork server imports them once
per process; each child is forked from it (a second loader's first batch with two children:
0.18 s against 1.6 s) and shares those pages with its siblings. Why not ``fork``: the fork
server is a fresh interpreter, so a child inherits no thread, lock, event loop, object-store
runtime or CUDA context of the training process, as with spawn.

What differs from spawn is taken care of: the fork server's environment is the one it started
with, so each child takes this process's (``start_child``, applied by ``child_main``);
``__main__`` is not preloaded there (a script without the main guard would end the fork server
instead of one child, which says what to change), so each child imports it, as spawn does.
"""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing import forkserver
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import Any

from .child import child_main

CHILD_MODULE = "asyncload.procs.child"  # what every child runs: torch, numpy, OpenCV, the pipeline


def start_method() -> str:
    """``"forkserver"`` where the platform has it, else ``"spawn"``."""
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def child_context() -> BaseContext:
    """The multiprocessing context children are started from. The fork server is
    multiprocessing's own, shared with the rest of this process: its preload list keeps what
    others put there (but ``__main__``) and gains the child's modules. Where it already runs,
    the list no longer matters: children then import what they need themselves."""
    method = start_method()
    context = multiprocessing.get_context(method)
    if method == "forkserver":
        server = getattr(forkserver, "_forkserver", None)  # CPython's one fork server
        preload = list(getattr(server, "_preload_modules", None) or [])
        if CHILD_MODULE not in preload:
            context.set_forkserver_preload([name for name in preload if name != "__main__"] + [CHILD_MODULE])
    return context


def start_child(index: int, payload: dict[str, bytes]) -> tuple[Any, BaseProcess]:
    """Child ``index`` running ``child_main`` on ``payload`` (the pickled pipeline settings),
    with this process's environment as it is now (the fork server's is older), and this
    process's end of its pipe."""
    context = child_context()
    conn, child_end = context.Pipe(duplex=True)
    process = context.Process(target=child_main, args=(child_end, payload, dict(os.environ)),
                              name=f"asyncload-{index}", daemon=True)
    try:
        process.start()
    except BaseException:
        conn.close()
        raise
    finally:
        child_end.close()  # the child's death must read as end-of-file here
    return conn, process
