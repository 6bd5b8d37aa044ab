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
instead of one child, which says what to change).

A child imports the user's ``__main__`` only when its arguments need it (``script.py``): else
it is started without it (``without_main``), so the script's top level never runs in it, guard
or not. The fork server also preloads ``server.py``, which ends every child's process group
when the fork server ends (it does once this process is gone: ``lifetime.py``).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
from collections.abc import Iterator
from multiprocessing import forkserver, spawn
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import Any

from .child import child_main

CHILD_MODULE = "asyncload.procs.child"  # what every child runs: torch, numpy, OpenCV, the pipeline
SERVER_MODULE = "asyncload.procs.server"  # the fork server's own: ends the children's groups with it


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
            context.set_forkserver_preload([name for name in preload if name not in ("__main__", SERVER_MODULE)]
                                           + [SERVER_MODULE, CHILD_MODULE])
    return context


def start_child(index: int, count: int, payload: dict[str, bytes], main: bool = True) -> tuple[Any, BaseProcess]:
    """Child ``index`` of ``count`` running ``child_main`` on ``payload`` (the loader's settings
    pickled field by field: ``LoaderSettings.for_children``),
    with this process's environment as it is now (the fork server's is older), and this
    process's end of its pipe. ``main``: whether the child imports the user's ``__main__``
    first (only to unpickle what the script defines: ``script.needs_main``)."""
    context = child_context()
    conn, child_end = context.Pipe(duplex=True)
    process = context.Process(target=child_main, args=(child_end, payload, count, dict(os.environ)),
                              name=f"asyncload-{index}", daemon=True)
    try:
        with contextlib.nullcontext() if main else without_main():
            process.start()
    except BaseException:
        conn.close()
        raise
    finally:
        child_end.close()  # the child's death must read as end-of-file here
    return conn, process


_local = threading.local()  # this thread is starting a child that must not import __main__


@contextlib.contextmanager
def without_main() -> Iterator[None]:
    """Children started on this thread meanwhile do not import the user's ``__main__``.
    multiprocessing tells a child to import it in the "preparation data" it sends first
    (``spawn.get_preparation_data``, called by every start method that is not a plain fork);
    no argument turns that off, so the function is wrapped, once, to leave the two entries out
    for this thread only: other threads' processes, the user's own included, are started as
    before."""
    _wrap_preparation()
    _local.without_main = True
    try:
        yield
    finally:
        _local.without_main = False


def _wrap_preparation() -> None:
    original = spawn.get_preparation_data
    if getattr(original, "asyncload_wrapped", False):
        return

    def get_preparation_data(name: str) -> dict[str, Any]:
        data = original(name)
        if getattr(_local, "without_main", False):
            data.pop("init_main_from_path", None)
            data.pop("init_main_from_name", None)
        return data

    get_preparation_data.asyncload_wrapped = True  # type: ignore[attr-defined]
    spawn.get_preparation_data = get_preparation_data
