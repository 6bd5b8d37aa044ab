"""The lock a node's processes share while one of them learns a shard set's member table
(``shard_learn``), with the shard cache's rule for a peer that stops (``io/cache_lock.py``): the
learner holds the lock file's ``flock`` and beats (touches its modification time) every third of
``patience`` while it learns; a waiter waits while the beat moves, and stops waiting once it has
stood still for ``patience`` (the request timeout: a stopped or hung learner), then learns the
table itself. A dead learner lets go of its flock, so its waiters take the lock at once.

Synchronous (the table is learnt while a source is built, perhaps with no event loop).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

from ..io import cache_files as files

POLL_S = 0.05


@contextlib.contextmanager
def held(path: str, patience: float, say: Callable[[str], None]) -> Iterator[bool]:
    """Holds the lock at ``path`` and beats it from a thread while the block runs; yields
    whether the lock is held (False: its holder showed no progress for ``patience`` seconds,
    and the block runs without it)."""
    lock = take(Path(path), patience, say)
    if lock is None:
        yield False
        return
    stop = threading.Event()
    beater = threading.Thread(target=_beat, args=(lock, max(patience / 3, POLL_S), stop), name="asyncload-learn-beat",
                              daemon=True)
    beater.start()
    try:
        yield True
    finally:
        stop.set()
        beater.join()
        os.close(lock)  # lets go of the flock


def take(path: Path, patience: float, say: Callable[[str], None]) -> int | None:
    """The lock's descriptor, once free; None when its holder's beat stood still for ``patience``."""
    lock = files.try_lock(path)
    if lock is not None:
        files.heartbeat(lock)
        return lock
    say(f"waiting for another process to learn the member table ({path})")
    beat, deadline = None, time.monotonic() + patience
    while True:
        lock = files.try_lock(path)
        if lock is not None:
            files.heartbeat(lock)
            return lock
        now, seen = time.monotonic(), files.last_beat(path)
        if seen != beat:
            beat, deadline = seen, now + patience
        elif now > deadline:
            say(f"the process learning the member table ({path}) showed no progress for {patience:g} s: "
                "learning it here too")
            return None
        time.sleep(POLL_S)


def _beat(lock: int, every: float, stop: threading.Event) -> None:
    while not stop.wait(every):
        files.heartbeat(lock)
