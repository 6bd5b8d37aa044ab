"""The shard cache's download of one shard into its folder (``cache.py`` decides when; this is
how): under the shard's lock (``cache_lock``), room made first (``_evict``), the bytes written to a
new partial file on a pool thread and renamed into place with their meta (``cache_files``), this
process's reads served from the file as its bytes land (``cache_progress``). The disk's failures
are ``CacheWriteError`` (the shard is then read from storage, see ``cache.py``); storage's pass.

Apart from ``cache.py`` because it is a unit of its own: what a download does on disk, and how a
cancel lets a pool thread's disk work end before its descriptor is closed (``_finish``).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any, Awaitable, Callable

from . import cache_files as files
from .blocking import to_the_end
from .cache_evict import default_budget
from .cache_lock import PeerLocks
from .cache_progress import Downloads

ReadRange = Callable[[str, int, int], Awaitable[bytes]]


class CacheWriteError(Exception):
    """The cache's own disk failed a download (not storage): the shard is read from storage."""



class ShardDownloads:
    """The download half of ``ShardCache`` (which sets these attributes and the methods below
    that it declares)."""

    directory: Path
    download: ReadRange
    chunk_bytes: int
    run_blocking: Callable[..., Awaitable[Any]]
    locks: PeerLocks
    streaming: Downloads | None
    max_bytes: int

    async def _evict(self, room: int, scan: bool = False) -> None:
        raise NotImplementedError

    def _skip(self, url: str, reason: str, message: str) -> bool:
        raise NotImplementedError

    def _warn(self, reason: str, message: str) -> None:
        raise NotImplementedError

    async def _try_lock(self, path: Path) -> int | None:
        """``cache_files.try_lock`` on the loop: a shard's lock is taken once per download."""
        return files.try_lock(path)

    async def _download(self, url: str, size: int, shard: files.ShardFiles, version: str) -> bool:
        try:
            lock = await self.locks.take(url, shard, self._try_lock)
        except OSError as error:
            return self._skip(url, "unwritable", f"cannot lock {shard.lock}: {error}")
        if lock is None:
            self._warn("lock", f"another process holds {shard.lock} and showed no progress for read_timeout "
                               f"({self.locks.timeout} s): reads of it go to storage while it stays so")
            return False
        beating = asyncio.ensure_future(self.locks.beat(lock))
        try:
            if await self._finish(files.current, shard, url, size, version):
                return True  # another process has just downloaded this version
            await self._evict(size)
            partial, installed = shard.new_part(), False
            try:
                crc = await self._fetch_to(url, size, partial)
                meta = {"url": url, "size": size, "version": version, "crc32": crc}
                await self._on_disk(files.install, shard, partial, meta)
                installed = True
            except ValueError as error:  # the shard is shorter than its index says (ShardTruncated)
                return self._skip(url, "short", str(error))
            except CacheWriteError as error:
                files.unlink(shard.shard)  # a copy without its meta is of no use: free the room
                files.unlink(partial)
                cause = error.__cause__
                if isinstance(cause, OSError) and cause.errno in files.DISK_FULL:  # the default's rule, from now
                    self.max_bytes = min(self.max_bytes, await self.run_blocking(default_budget, self.directory))
                    return self._skip(url, "full", f"the disk is full ({cause}); cache_bytes is now {self.max_bytes}")
                return self._skip(url, "unwritable", f"cannot write {partial}: {cause}")
            finally:
                if not installed:  # renamed into place: no name to free (an unlink on the loop waits for the folder)
                    files.unlink(partial)
            await self._evict(0)  # downloads of other shards, here and elsewhere, may have overlapped
            return True
        finally:
            beating.cancel()
            os.close(lock)  # also releases the flock; no disk work of ours is running (``_finish``)

    async def _fetch_to(self, url: str, size: int, partial: Path) -> int:
        """Downloads ``url`` into ``partial``; returns its crc32. Storage's errors pass; the
        disk's are ``CacheWriteError``."""
        fd = await self._on_disk(files.new_file, partial, undo=os.close)
        progress = None
        try:
            await self._on_disk(files.reserve, fd, size)
            if self.streaming is not None:  # our own new file, open for the reads served from it
                progress = self.streaming.start(url, os.open(partial, files.READ_FLAGS))
            crc = 0
            for start in range(0, size, self.chunk_bytes):
                end = min(size, start + self.chunk_bytes)
                data = await self.download(url, start, end)
                if progress is not None:
                    self.streaming.hold(progress, start, data)  # type: ignore[union-attr]
                crc = await self._on_disk(files.write_all, fd, data, crc)
                if progress is not None:
                    self.streaming.advance(progress, end)  # type: ignore[union-attr]
            return crc
        finally:
            if progress is not None:
                self.streaming.end(url, progress)  # type: ignore[union-attr]
            os.close(fd)

    async def _on_disk(self, function: Callable[..., Any], *args: Any, undo: Callable[[Any], Any] | None = None) -> Any:
        try:
            return await self._finish(function, *args, undo=undo)
        except OSError as error:
            raise CacheWriteError(str(error)) from error

    async def _finish(self, function: Callable[..., Any], *args: Any, undo: Callable[[Any], Any] | None = None) -> Any:
        """``run_blocking(function, *args)``, let finish when the caller is cancelled (a pool
        thread cannot be stopped: closing the descriptor it writes, or releasing the lock, under
        it would write to whatever file reuses that number); then ``undo`` is given its result
        (a descriptor opened for nothing is closed) and the cancel goes on."""
        work = asyncio.ensure_future(self.run_blocking(function, *args))
        try:
            return await to_the_end(work)
        except asyncio.CancelledError:
            if undo is not None and not work.cancelled() and work.exception() is None:
                undo(work.result())
            raise
