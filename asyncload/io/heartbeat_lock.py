"""A lock the processes of a node share, with a heartbeat: the one rule for telling a holder that
works slowly from one that stopped.

The holder keeps the lock file's ``flock`` and beats (touches the file's modification time) from a
timer every third of ``patience`` while it holds it, not after each piece of work: a piece that is
retried takes longer than ``patience``, and only a stalled holder (stopped, a hung disk) stops
beating. A waiter waits while the beat moves and gives up once it stood still for ``patience``
(then it does the work itself: reads storage, learns the table); a dead holder lets go of its
``flock``, so a waiter takes the lock at once.

Two users: the shard cache waits on a peer's download on the reader's event loop
(``cache/lock.py``'s ``PeerLocks``, asynchronous), and a source learns a shard set's member table while it
is built, perhaps with no event loop (``sources/shard_learn``, ``held``). The wait is one class,
``LockWait``, whose clock and sleep can be replaced, so it is tested as logic.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from pathlib import Path
from typing import Awaitable, Callable, Iterator

from ..cache import files

POLL_S = 0.05  # how often a waiter tries the lock and looks at the beat


class LockWait:
    """One wait on the lock at ``path``: tries it every ``POLL_S`` and gives up once its holder's
    beat stood still for ``patience`` seconds (``beat`` is then the beat it stood still at).
    ``clock`` and ``sleep`` are the real ones but in tests."""

    def __init__(self, path: Path, patience: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self.patience = patience
        self.clock = clock
        self.beat: int | None = None  # the holder's last beat seen
        self.deadline = clock() + patience  # when a beat that has not moved since is given up on

    def holder_stalled(self) -> bool:
        """Looks at the holder's beat once: True when it has not moved for ``patience`` seconds."""
        now, seen = self.clock(), files.last_beat(self.path)
        if seen != self.beat:
            self.beat, self.deadline = seen, now + self.patience
            return False
        return now > self.deadline

    def take(self, on_wait: Callable[[], None] | None = None, sleep: Callable[[float], None] = time.sleep) -> int | None:
        """The lock's descriptor (beaten once), once free; None when its holder stalled.
        ``on_wait()`` is called once, if the lock is held at the first try."""
        while True:
            lock = files.try_lock(self.path)
            if lock is not None:
                files.heartbeat(lock)
                return lock
            if on_wait is not None:
                on_wait()
                on_wait = None
            if self.holder_stalled():
                return None
            sleep(POLL_S)

    async def take_async(self, try_lock: Callable[[Path], Awaitable[int | None]],
                         sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> int | None:
        """As ``take``, on an event loop: ``try_lock`` is ``cache/files.py``'s ``try_lock`` run off the
        loop, as one attempt that a cancel never loses (a descriptor taken is closed)."""
        while True:
            lock = await try_lock(self.path)
            if lock is not None:
                files.heartbeat(lock)
                return lock
            if self.holder_stalled():
                return None
            await sleep(POLL_S)


def beat_period(patience: float) -> float:
    """How often a holder beats: a third of ``patience``, so a waiter sees the beat move twice or
    more before it would give up, even when one beat comes late."""
    return patience / 3


async def beat_async(lock: int, patience: float) -> None:
    """Touches the held ``lock``'s beat every ``beat_period(patience)`` until cancelled."""
    while True:
        await asyncio.sleep(beat_period(patience))
        files.heartbeat(lock)


@contextlib.contextmanager
def held(path: Path, patience: float, on_wait: Callable[[], None] | None = None,
         on_stalled: Callable[[], None] | None = None, name: str = "asyncload-lock-beat") -> Iterator[bool]:
    """Holds the lock at ``path`` and beats it from a thread while the block runs; yields whether
    the lock is held (False: its holder stalled, ``on_stalled()`` was called, and the block runs
    without it). ``on_wait()``: called once if the lock is held by another at first. Synchronous:
    for work done with no event loop."""
    lock = LockWait(path, patience).take(on_wait)
    if lock is None:
        if on_stalled is not None:
            on_stalled()
        yield False
        return
    stop = threading.Event()
    every = max(beat_period(patience), POLL_S)  # a short timeout must not make the beat a spin
    beater = threading.Thread(target=_beat, args=(lock, every, stop), name=name, daemon=True)
    beater.start()
    try:
        yield True
    finally:
        stop.set()
        beater.join()
        os.close(lock)  # lets go of the flock


def _beat(lock: int, every: float, stop: threading.Event) -> None:
    while not stop.wait(every):
        files.heartbeat(lock)
