"""A local disk cache of remote shards, bounded in size, shared safely by the processes and users
of one machine (the ranks of a node, several jobs), which never stops an epoch that storage alone
could serve.

A shard is downloaded whole (large sequential ranged reads) into a temporary file, reserved at
its full size first (``files.reserve``: cheaper writes, and a full disk found before the
download), and renamed into place, so no process ever sees half a shard; this process's own reads
of it are served from that file as soon as their bytes are written (``download.Downloads``), so the
cold epoch decodes a shard's first chunk while the rest still downloads. A per-shard lock file (``flock``) lets one
process download while the others wait for its file instead of downloading it again. Before each
download the least recently used shards are deleted until the cache has room for it within
``max_bytes``, except those this process is reading (the cache exceeds its size by those until
they are released); a shard another process deletes just before it is read is simply downloaded
again (after three such races in a row, the read goes straight to storage: the cache is too
small for its users). The files, their names and what the cache may touch: ``files``.

A kept shard is served only while it is what the URL holds: it must have the index's size, the
remote object's version (its ETag, else its modification time: ``version``, asked once per run
(a loader: what one pass learnt, ``current``, serves its next passes, which ask storage nothing)
and shard) recorded at download, and, read whole once per process, the checksum recorded at
download (a copy damaged on disk is downloaded again). A copy damaged after that check (bit rot
keeps the modification time) is found when a sample read from it fails to decode: ``damaged``
reads it whole again, once per copy and run, and deletes it if its checksum no longer holds, so the
sample is read again from a fresh download (``ShardStream.refetched``); a copy that holds (the
object itself is bad) lets the failure stand.

The epoch goes on whatever the cache's disk does. A shard is read straight from storage, for the
rest of the run and with one warning, where the cache cannot serve it: larger than ``max_bytes``;
the disk full (``ENOSPC``/``EDQUOT``: the partial file is removed and the budget shrinks to the
default's rule, below, on the disk as it is now); or the folder not writable. A peer holding its
lock that shows no progress for ``timeout`` (the read timeout: no wait is longer) sends only the
reads while it stays so to storage (``lock``). A cancelled download lets its disk work on a
pool thread finish: the descriptor it writes is closed, and the lock released, only after it.
When storage cannot be asked (the version check fails after its retries with a transient
error), a kept copy whose checksum holds is used unasked for ``offline.OFFLINE_S``, then asked about
again; a permanent error (the object is gone) fails.

``max_bytes=None``: the smaller of ``DEFAULT_CAP`` and ``FREE_FRACTION`` of the disk's free space
at the start of the run plus what the cache already keeps (``evict.default_budget``). How one
download runs, on disk and when cancelled: ``download``.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Awaitable, Callable

from . import files
from .download import Downloads, ReadRange, ShardDownloads
from .evict import default_budget, evict
from .lock import PeerLocks
from .offline import OfflineWindow

Version = Callable[[str], Awaitable[str]]

FINISH_S = 10.0  # how long the end of a run waits for its downloads under way before cancelling them

_warned: set[tuple[str, str]] = set()  # (folder, reason): each warned once per process


class ShardCache(ShardDownloads):
    """``read_range(url, start, end, size)``: bytes of a remote shard, from the local copy."""

    def __init__(self, directory: str | os.PathLike, max_bytes: int | None, download: ReadRange, chunk_bytes: int,
                 run_blocking: Callable[..., Awaitable[Any]], version: Version | None = None,
                 timeout: float = 60.0, current: dict[str, float] | None = None) -> None:
        self.directory = Path(directory)
        self.download = download  # async (url, start, end) -> bytes, retried by the reader
        self.chunk_bytes = chunk_bytes
        self.run_blocking = run_blocking  # runs file work off the event loop
        self.version = version  # async url -> the remote object's version (ETag or mtime), if known
        self.locks = PeerLocks(timeout)
        self.streaming: Downloads | None = Downloads()  # reads served from this process's downloads under way
        # url -> until when its copy is current without asking (time.monotonic(); math.inf once
        # its version was asked or it was downloaded): ``current``, the loader's for all its passes
        self._checked: dict[str, float] = {} if current is None else current
        self._touched: set[str] = set()  # copies marked used by this run's reads from decode threads
        self._bypass: set[str] = set()  # urls read from storage for the rest of this run
        self._downloads: dict[str, asyncio.Future] = {}  # this process's downloads in progress
        self._rechecks: dict[files.CopyId, asyncio.Future] = {}  # copies whose samples failed: sound?
        self._in_use: Counter[Path] = Counter()  # shards this process is reading: never evicted
        self._over_size = False  # the last eviction had to keep shards in use past max_bytes
        self._offline = OfflineWindow(self._warn)  # storage could not be asked: copies used unasked
        self.max_bytes = 0
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.max_bytes = max_bytes if max_bytes is not None else default_budget(self.directory)
            evict(self.directory, self.max_bytes, set())  # a run that downloads nothing cleans up too
        except OSError as error:
            self._warn("folder", f"cannot use {error}; shards are read from storage")
            self._usable = False
        else:
            self._usable = True

    async def aclose(self) -> None:
        """Lets this process's downloads end (their reads may all have been served before: the
        copy must still be kept for the next epoch) for up to ``FINISH_S``, then cancels those
        left (their partial files are removed), before the reader they use closes; then scans
        the folder and evicts whatever passes ``max_bytes``, whether or not a download was under
        way: an eviction during the run may have kept copies then in use, and no later read
        would retry it."""
        pending = list(self._downloads.values())
        if pending:
            await asyncio.wait(pending, timeout=min(FINISH_S, self.locks.timeout))
        for download in pending:
            download.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if self._usable:
            await self._evict(0, scan=True)

    def path(self, url: str) -> Path:
        """Where ``url``'s copy is kept."""
        return files.shard_files(self.directory, url).shard

    def kept_copy(self, url: str, size: int) -> Path | None:
        """On the loop: where ``url``'s copy is if this process already knows it current (no
        question to storage, no download), for a decode thread to read samples from it
        (``files.read_checked_range``); else None (``read_copy`` serves the read). The
        copy is marked used once per run."""
        if not self._usable or url in self._bypass or self._checked.get(url, 0.0) <= time.monotonic():
            return None
        path = self.path(url)
        if url not in self._touched:
            if not files.touch(path, size):
                self._checked.pop(url, None)  # evicted by a peer: looked at again by ``ensure``
                return None
            self._touched.add(url)
        return path

    def forget(self, url: str, size: int) -> None:
        """On the loop: ``url``'s copy is no longer known current (a decode thread found another
        file there than the one this process checked): the next ``ensure`` checks it whole. Not
        if the file there is checked since (the other reads found replaced before that check
        ask storage nothing again)."""
        if not files.is_checked(self.path(url), size):
            self._checked.pop(url, None)

    async def read_range(self, url: str, start: int, end: int, size: int) -> bytes:
        return (await self.read_copy(url, start, end, size))[0]

    async def read_copy(self, url: str, start: int, end: int, size: int) -> tuple[bytes, files.CopyId | None]:
        """``read_range``'s bytes, and which copy they came from (None: from storage), for
        ``damaged`` to tell whether a sample's failed decode may be the copy's fault."""
        if url in self._bypass or not self._usable:
            return await self.download(url, start, end), None
        path = self.path(url)
        self._in_use[path] += 1
        try:
            for _ in range(3):  # evicted by another process between download and read: again
                ensuring = asyncio.ensure_future(self.ensure(url, size))
                try:
                    if self.streaming is not None:
                        served = await self.streaming.serve(url, start, end, ensuring, self._finish)
                        if served is not None:
                            return served, None
                    kept = await ensuring
                finally:
                    if not ensuring.done():  # served from the download (or cancelled): its wait ends
                        ensuring.cancel()
                        ensuring.add_done_callback(_retrieved)
                if not kept:
                    break
                try:
                    return await self._from_copy(url, start, end, size)
                except FileNotFoundError:
                    self._checked.pop(url, None)
        finally:
            self._in_use[path] -= 1
            if not self._in_use[path]:
                del self._in_use[path]
                if self._over_size:
                    await self._evict(0)
        # Bypassed, or evicted by others between download and read three times (the cache is
        # too small for the processes sharing it): serve the read from storage, never fail it.
        return await self.download(url, start, end), None

    async def _from_copy(self, url: str, start: int, end: int, size: int) -> tuple[bytes, files.CopyId]:
        """Bytes ``[start, end)`` of the kept copy of ``url``; FileNotFoundError if it is gone."""
        return await self.run_blocking(files.read_copy_range, self.path(url), start, end, size)

    async def damaged(self, url: str, size: int, copy: files.CopyId) -> bool:
        """Whether bytes that failed to decode (or parse), read from ``copy`` of ``url``, may
        be read again from a sound copy: ``copy`` was replaced, or is damaged and so deleted
        (``files.recheck``). Checked once per copy and run, however many samples fail."""
        check = self._rechecks.get(copy)
        if check is None:
            check = self._rechecks[copy] = asyncio.ensure_future(
                self.run_blocking(files.recheck, files.shard_files(self.directory, url), size, copy))
        if not await asyncio.shield(check):
            return False
        self._checked.pop(url, None)  # the next read looks at the copy again, and downloads it
        return True

    async def ensure(self, url: str, size: int) -> bool:
        """True once a current copy of ``url`` (``size`` bytes) is kept, downloaded if no
        process has one yet; False if this shard is read from storage (see the module)."""
        shard = files.shard_files(self.directory, url)
        if self._checked.get(url, 0.0) > time.monotonic() and files.touch(shard.shard, size):
            return True  # recently used: evicted last
        if url in self._bypass or self.locks.still_stalled(url, shard):
            return False
        if size > self.max_bytes:
            return self._skip(url, "large", f"{url} ({size} bytes) is larger than cache_bytes ({self.max_bytes})")
        version = await self._remote_version(url)
        if await self.run_blocking(files.current, shard, url, size, version):
            self._checked[url] = math.inf if version is not None else self._offline.until
            files.touch(shard.shard, size)
            return True
        if version is None:  # no copy to fall back on: ask (and fail after the retries) anyway
            version = await self._ask_version(url)
        pending = self._downloads.get(url)
        if pending is None:
            pending = self._downloads[url] = asyncio.ensure_future(self._download(url, size, shard, version))
            pending.add_done_callback(lambda _: self._downloads.pop(url, None))
            pending.add_done_callback(lambda task: self._kept(url, task))
        if not await asyncio.shield(pending):
            return False
        self._checked[url] = math.inf
        return True

    def _kept(self, url: str, download: asyncio.Future) -> None:
        """A download that kept its copy makes it current, whether or not a read still waits
        for it (the cold epoch's reads are served from the download under way)."""
        if not download.cancelled() and download.exception() is None and download.result():
            self._checked[url] = math.inf

    async def _remote_version(self, url: str) -> str | None:
        """The remote object's version, or None while storage cannot be asked (see the module)."""
        answered, version = await self._offline.asked(url, lambda: self._ask_version(url))
        return version if answered else None

    async def _ask_version(self, url: str) -> str:
        return "" if self.version is None else await self.version(url)

    async def _evict(self, room: int, scan: bool = False) -> None:
        """Evicts until ``room`` more bytes fit ``max_bytes`` (every call scans the folder once;
        ``scan`` is the end of a run's call)."""
        try:
            self._over_size = await self.run_blocking(evict, self.directory, self.max_bytes - room,
                                                      set(self._in_use))
        except OSError as error:
            self._warn("evict", f"cannot evict: {error}")

    def _skip(self, url: str, reason: str, message: str) -> bool:
        """Reads ``url`` from storage for the rest of the run; warns once per reason."""
        self._bypass.add(url)
        self._warn(reason, f"{message}: read from storage, not cached")
        return False

    def _warn(self, reason: str, message: str) -> None:
        if (str(self.directory), reason) not in _warned:
            _warned.add((str(self.directory), reason))
            warnings.warn(f"asyncload shard cache {self.directory}: {message}", RuntimeWarning, stacklevel=2)


def _retrieved(task: asyncio.Future) -> None:
    """Takes a cancelled wait's outcome, so that asyncio does not log it as never retrieved."""
    if not task.cancelled():
        task.exception()
