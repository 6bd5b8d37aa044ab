"""A script without ``if __name__ == "__main__":`` guard: spawn imports it again in each child,
whose top level would create a loader and start more processes. The child exits with a code
the parent recognises, and the parent says, in one line, what to change.
"""

from __future__ import annotations

import multiprocessing
import sys

from .protocol import MAIN_GUARD_EXIT


def refuse_while_bootstrapping(say: bool = True) -> None:
    """In a child that spawn is preparing, the user's script is being imported again: a script
    whose top level creates the loader (no ``if __name__ == "__main__":`` guard) would start
    processes from there, and multiprocessing would fail with a message about bootstrapping.
    Say what to do instead (unless the parent says it: ``say=False``), and exit with a code the
    parent recognises."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        if say:
            sys.stderr.write(guard_advice() + "\n")
            sys.stderr.flush()
        raise SystemExit(MAIN_GUARD_EXIT)


def guard_advice() -> str:
    script = getattr(sys.modules.get("__main__"), "__file__", None) or "your script"
    return (f"asyncload: processes= (and isolate=True) start processes with 'spawn', which imports {script} again "
            f"in each of them; its top level creates an AsyncLoader, so every process would start more. Put the "
            f"script's top-level code under `if __name__ == \"__main__\":`")
