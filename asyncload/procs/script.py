"""Whether a child must import the user's script (``__main__``), and whether that would run it again.

multiprocessing's children (spawned, or forked by the fork server) import ``__main__`` again,
as ``__mp_main__``, before they run anything: so that what the script defines can be unpickled
there. A script without ``if __name__ == "__main__":`` then runs its top level again in every
child: its own DataLoader, its timing, its prints, before the child ever reaches the loader. On
Linux, DataLoader users rarely write the guard (fork needs none), and the default
(``processes=None``) must not change what their script does.

So a child imports ``__main__`` only when what it is given needs it (``needs_main``: a function
or class the script itself defines), and ``start.py`` starts the others without it. When one
would need it and the script's top level does more than define things (``rerun_hazard``), the
default stays in this process and an explicit ``processes=N`` fails here, both with one line
that says what to change, before any child starts. A child that imports a script which builds a
loader anyway exits with a code the parent recognises (``refuse_while_bootstrapping``).
"""

from __future__ import annotations

import ast
import multiprocessing
import os
import sys
from multiprocessing import process
from typing import Any

from .protocol import MAIN_GUARD_EXIT

GUARD = 'if __name__ == "__main__":'


def needs_main(payload: dict[str, bytes]) -> str | None:
    """The first argument whose pickle names something of ``__main__`` (a child must import
    the script to unpickle it); None when none does. A plain search of the bytes: a string that
    happens to contain ``__main__`` errs on the safe side."""
    for name, data in payload.items():
        if b"__main__" in data:
            return name
    return None


def rerun_hazard() -> str | None:
    """Why importing the script again would run more than definitions (the first top-level
    statement outside ``if __name__ == "__main__":`` that does work, and the line this process
    is running from if that is one), as words for a message; None where a child's import only
    defines things, or where a child cannot import the script at all (an interactive session:
    ``choice.py`` says so)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or path is None or os.path.splitext(os.path.basename(path))[0] == "ipython":
        return None  # multiprocessing itself skips IPython's launcher
    spec_name = getattr(getattr(main, "__spec__", None), "name", None) or ""
    if spec_name == "__main__" or spec_name.endswith(".__main__"):
        return None  # ``python -m package``: multiprocessing never runs a package's __main__ again
    if not os.path.isabs(path) and process.ORIGINAL_DIR is not None:
        path = os.path.join(process.ORIGINAL_DIR, path)  # where multiprocessing looks for it too
    try:
        with open(path, "rb") as file:
            tree = ast.parse(file.read(), path)
    except (OSError, SyntaxError, ValueError):
        return None  # not a source file (a zip app, a frozen script): nothing to tell
    running = _running_line(main)
    for statement in tree.body:
        if running is not None and statement.lineno <= running <= (statement.end_lineno or statement.lineno):
            if not _is_guard(statement):
                return f"its line {running} runs this loader from the top level"
        work = _work(statement)
        if work is not None:
            return f"its top level runs {work}"
    return None


def hazard_advice(name: str, value: Any, hazard: str) -> str:
    """The one line naming what needs the script, why importing it is a problem, and the two
    ways out. ``name``/``value``: the argument that needs it (``needs_main``)."""
    script = getattr(sys.modules.get("__main__"), "__file__", None) or "the script"
    defined = getattr(value, "__module__", None) == "__main__" and getattr(value, "__qualname__", None)
    if not defined and getattr(type(value), "__module__", None) == "__main__":
        defined = type(value).__qualname__
    what = defined or "the functions and classes it uses"
    return (f"{name}= needs {what} from {script}, so each child process would import the script again, and "
            f"{hazard} outside `{GUARD}`, which would run again in every child: put the script's top-level "
            f"code under `{GUARD}`, or define {what} in a module of its own")


def script_refusal(payload: dict[str, bytes], arguments: dict[str, Any]) -> str | None:
    """Why children cannot be started for these arguments without running the user's script
    again (``hazard_advice``'s line); None when they can."""
    needed = needs_main(payload)
    if needed is None:
        return None
    hazard = rerun_hazard()
    return None if hazard is None else hazard_advice(needed, arguments[needed], hazard)


def _running_line(main: Any) -> int | None:
    """The line of the script's top level this thread is running (the loader is created or
    iterated from there, maybe through functions); None if it is not on this thread's stack."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals is main.__dict__ and frame.f_code.co_name == "<module>":
            return frame.f_lineno
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _is_guard(statement: ast.stmt) -> bool:
    """``if __name__ == "__main__":`` (either way round)."""
    if not isinstance(statement, ast.If) or not isinstance(statement.test, ast.Compare):
        return False
    test = statement.test
    if len(test.ops) != 1 or not isinstance(test.ops[0], ast.Eq):
        return False
    sides = [test.left, test.comparators[0]]
    names = [side for side in sides if isinstance(side, ast.Name) and side.id == "__name__"]
    constants = [side for side in sides if isinstance(side, ast.Constant) and side.value == "__main__"]
    return len(names) == 1 and len(constants) == 1


# Calls an assignment may make and still only define a name: they compute, start nothing.
PURE_CALLS = frozenset({
    "logging.getLogger", "getLogger", "TypeVar", "typing.TypeVar", "ParamSpec", "typing.ParamSpec",
    "NewType", "typing.NewType", "namedtuple", "collections.namedtuple", "NamedTuple", "typing.NamedTuple",
    "os.getcwd", "os.getenv", "os.environ.get", "re.compile", "Path", "pathlib.Path", "field",
    "dataclasses.field", "int", "float", "str", "bool", "bytes", "dict", "list", "tuple", "set", "frozenset",
    "object", "range",
})
PURE_PREFIXES = ("os.path.",)


def _work(statement: ast.stmt) -> str | None:
    """What ``statement`` does beyond defining names, in words with its line; None for
    imports, functions, classes, docstrings, the main guard, assignments that call nothing but
    ``PURE_CALLS``, and ``if``/``try`` blocks made of those. An assignment that calls anything
    else is work: ``ds = download()``, ``model = Net().cuda()``, ``loader = AsyncLoader(...)``
    would run again in every child."""
    if isinstance(statement, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        return None if _impure_call(statement.value) is None else _describe(statement)
    if _is_guard(statement) or isinstance(statement, (ast.Import, ast.ImportFrom, ast.FunctionDef,
                                                      ast.AsyncFunctionDef, ast.ClassDef, ast.Pass, ast.Global,
                                                      ast.Nonlocal, ast.Delete, ast.Assert)):
        return None
    if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
        return None  # a docstring
    if isinstance(statement, ast.If):
        blocks = [statement.body, statement.orelse]
    elif isinstance(statement, ast.Try):
        blocks = [statement.body, statement.orelse, statement.finalbody, *(h.body for h in statement.handlers)]
    else:
        blocks = None
    if blocks is not None:
        for block in blocks:
            for inner in block:
                work = _work(inner)
                if work is not None:
                    return work
        return None
    return _describe(statement)


def _describe(statement: ast.stmt) -> str:
    """A statement's first line (shortened) and its line number, for a message."""
    lines = ast.unparse(statement).splitlines()
    text = lines[0] + (" ..." if len(lines) > 1 else "")
    if len(text) > 60:
        text = text[:57] + "..."
    return f"`{text}` at line {statement.lineno}"


def _impure_call(value: ast.expr | None) -> ast.Call | None:
    """The first call in ``value`` (an assignment's right side) that is not one of
    ``PURE_CALLS``; None if there is none. A lambda's body runs later, not here."""
    if value is None:
        return None
    pending: list[ast.AST] = [value]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Lambda):
            continue
        if isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name is None or not (name in PURE_CALLS or name.startswith(PURE_PREFIXES)):
                return node
        pending.extend(ast.iter_child_nodes(node))
    return None


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` for a name or a chain of attributes on a name; None for anything else (a
    method called on a call's result, say)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


# ----- a child importing a script that builds a loader -----
# A script without ``if __name__ == "__main__":`` guard: each child imports it again (spawned or
# forked by the fork server), and its top level would create a loader and start more processes.
# The child exits with a code the parent recognises, and the parent says, in one line, what to
# change.

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
