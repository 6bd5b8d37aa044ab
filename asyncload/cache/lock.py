"""Waiting on a peer's download of a shard (the processes of a node share the cache): which
peer is alive, and for how long a read waits. The downloader holds the shard's ``flock`` and
beats (touches the lock file's modification time) from a timer every third of ``timeout`` while
it holds it, not after each chunk: a chunk whose GET is retried takes longer than ``timeout``,
and only a stalled peer (stopped, a hung disk) stops beating; a dead one lets go of its flock. A
wait on a peer whose heartbeat stood still for ``timeout`` ends (that read goes to storage), and
so do the next reads of that shard at once while that peer still holds it unmoved; once it moves
or lets go, the shard is waited for, or downloaded, again (never given up for the run).
The lock, its wait and its heartbeat are ``heartbeat_lock``'s (shared with the member-table
learner); what is the cache's own here is the memory of the peers a read gave up on."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Awaitable, Callable

from . import files
from ..io.heartbeat_lock import POLL_S as LOCK_POLL_S  # noqa: F401 - its name here before the lock was shared
from ..io.heartbeat_lock import LockWait, beat_async


class PeerLocks:
    """Takes shards' locks for one process's cache, remembering the peers it gave up on."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout  # the longest wait on a peer's lock without progress (read_timeout)
        self._stalled: dict[str, int | None] = {}  # url -> the heartbeat of the peer a read gave up on

    def still_stalled(self, url: str, shard: files.ShardFiles) -> bool:
        """Whether the peer whose lock an earlier read of ``url`` gave up on still holds it with
        the heartbeat it had then: this read goes to storage without waiting ``timeout`` again."""
        if url not in self._stalled:
            return False
        if files.last_beat(shard.lock) == self._stalled[url]:
            try:
                lock = files.try_lock(shard.lock)
            except OSError:
                lock = None
            if lock is None:
                return True
            os.close(lock)
        del self._stalled[url]  # it moved, or let go: wait on it, or download, as for any shard
        return False

    async def take(self, url: str, shard: files.ShardFiles, try_lock: Callable[[Path], Awaitable[int | None]]) -> int | None:
        """Takes the shard's lock (a descriptor) with ``try_lock`` (one non-blocking attempt that
        a cancel never loses); None if a peer holds it and its heartbeat stood still for
        ``timeout`` (remembered: ``still_stalled``)."""
        wait = LockWait(shard.lock, self.timeout)
        lock = await wait.take_async(try_lock)
        if lock is None:
            self._stalled[url] = wait.beat
        else:
            self._stalled.pop(url, None)
        return lock

    async def beat(self, lock: int) -> None:
        """Touches the held ``lock``'s heartbeat every third of ``timeout`` until cancelled."""
        await beat_async(lock, self.timeout)
