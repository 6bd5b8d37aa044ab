"""A script without ``if __name__ == "__main__":`` guard: each child imports it again (spawned or
forked by the fork server), and its top level would create a loader and start more processes.
The child exits with a code the parent recognises, and the parent says, in one line, what to
change.
"""

from __future__ import annotations

import multiprocessing
import os
import sys

from .protocol import MAIN_GUARD_EXIT


def refuse_while_bootstrapping(say: bool = True) -> None:
    """In a child being prepared (spawned, or forked by the fork server), the user's script is
    being imported again: a script whose top level creates the loader (no ``if __name__ ==
    "__main__":`` guard) would start processes from there, and multiprocessing would fail with
    a message about bootstrapping. Say what to do instead (unless the parent says it:
    ``say=False``), and exit with a code the parent recognises: ``os._exit``, since the fork
    server's child turns a ``SystemExit`` raised while it is prepared into exit code 1."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        if say:
            sys.stderr.write(guard_advice() + "\n")
        sys.stderr.flush()
        os._exit(MAIN_GUARD_EXIT)


def guard_advice() -> str:
    script = getattr(sys.modules.get("__main__"), "__file__", None) or "your script"
    return (f"asyncload: processes= (and isolate=True) start processes that import {script} "
            f"again; its top level creates an AsyncLoader, so every process would start more. Put the script's "
            f"top-level code under `if __name__ == \"__main__\":`")
