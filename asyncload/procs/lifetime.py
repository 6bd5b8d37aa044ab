"""No child outlives the process that started it, however that process ends.

The ways a parent ends that run no code of ours (SIGKILL, SIGTERM's default action,
``os._exit``, the out-of-memory killer) are the ones that matter, so the children watch, not
the parent:

- each child leads a process group of its own (``lead_group``): whatever it starts (a user's
  DataLoader workers in a decode, say) is in it, and is ended with it (``end_group``);
- each child's lifeline thread waits for the end of its parent's pipe and then ends its group
  (``child.py``);
- the fork server notices this process's end by itself (its "alive" pipe reads end-of-file)
  and, before it exits, ends the group of every child it forked (``server.py``), which also
  reaches a child still being prepared; on Linux each of those children also gets SIGKILL when
  the fork server is gone (``die_with_parent``), in case the fork server itself was killed.

A group of its own also keeps the terminal's Ctrl-C (sent to the foreground group) to the
parent, which handles it; children ignored it already. Linux first: elsewhere ``prctl`` does
not exist and only the lifeline and the groups remain.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from typing import Any

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _prctl() -> Any:
    """libc's ``prctl``, looked up once (from the symbols already loaded: no search for the
    library, which would start a process); None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()


def die_with_parent(parent: int) -> None:
    """On Linux: this process gets SIGKILL when the thread that forked it ends (the fork
    server's only thread: the server's end). ``parent``: its pid before the fork; if the
    parent ended before the signal was armed, the process ends now (the race the man page
    warns of). Called right after a fork, so it does nothing but a system call."""
    if _PRCTL is None or _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return
    if os.getppid() != parent:
        os._exit(1)


def lead_group() -> bool:
    """Makes this process the leader of a new process group; False where it cannot (it leads
    a session already, or the platform refuses)."""
    try:
        os.setpgid(0, 0)
    except OSError:
        return False
    return True


def leads_group(pid: int) -> bool:
    """Whether ``pid`` leads its own process group."""
    try:
        return os.getpgid(pid) == pid
    except OSError:
        return False


def end_group(pid: int) -> None:
    """SIGKILL to ``pid`` and to the process group it leads, if it leads one. ``pid`` must be
    a process not yet waited for (alive or a zombie), so that the number is still its own."""
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)  # no such group (it never led one): nothing to end there
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)


def end_others_in_group() -> None:
    """From a child leading its group: SIGKILL to every other process in it (what the child's
    code started), leaving this one to exit with its own code."""
    pid = os.getpid()
    if not leads_group(pid):
        return
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != pid:
                with contextlib.suppress(OSError):
                    if os.getpgid(int(entry)) == pid:
                        os.kill(int(entry), signal.SIGKILL)
