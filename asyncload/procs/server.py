"""Imported by multiprocessing's fork server only (``start.py`` preloads it, nothing else
imports it): the fork server outlives this process by nothing, and neither do its children.

The fork server exits by itself once the process that started it is gone (its "alive" pipe
reads end-of-file), whatever killed that process; then, from ``atexit``, it ends the process
group of each child it forked (``lifetime.end_group``): the children, and whatever they started,
are gone before it is. Each child it forks also dies with it (``lifetime.die_with_parent``,
set right after the fork, before the child imports anything), should it be killed instead;
what those children fork in turn is left alone (``_after_fork_in_child``).

Nothing happens where this module is imported outside a fork server (``_in_fork_server``). A
fork server that something else started first (without this module) lacks both: the children's
own lifeline and process groups (``child.py``) remain.
"""

from __future__ import annotations

import atexit
import os
import sys
from multiprocessing import forkserver

import psutil

from .lifetime import die_with_parent, end_group


def _in_fork_server() -> bool:
    """Whether this import runs inside ``multiprocessing.forkserver.main`` (its preloading)."""
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code is forkserver.main.__code__:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _end_children() -> None:
    """Every child of the fork server, with its process group where it leads one. The server
    exits once the process that started it is gone, which joined its own children first if it
    could: what is left was orphaned."""
    try:
        pids = [child.pid for child in psutil.Process().children()]
    except psutil.Error:
        return
    for pid in pids:  # not waited for yet: the server's SIGCHLD handler cannot run any more
        end_group(pid)


_server = 0  # the fork server's pid, where this module runs in one
_forking = 0  # the pid of the process forking now (set before each fork, read in the new process)


def _before_fork() -> None:
    global _forking
    _forking = os.getpid()


def _after_fork_in_child() -> None:
    """Only in a child of the fork server itself: the hooks are inherited by every descendant,
    and a process that a child forks (a decode's own Pool, DataLoader workers) must neither die
    with the thread that forked it nor take its parent for a dead fork server."""
    if _forking == _server:
        die_with_parent(_server)


if _in_fork_server():
    _server = os.getpid()
    atexit.register(_end_children)
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
