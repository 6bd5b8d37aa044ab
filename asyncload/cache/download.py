"""The shard cache's download of one shard into its folder (``shards.py`` decides when; this is
how): under the shard's lock (``lock``), room made first (``_evict``), the bytes written to a
new partial file on a pool thread and renamed into place with their meta (``files``), this
process's reads served from the file as its bytes land (``Downloads``, below). The disk's failures
are ``CacheWriteError`` (the shard is then read from storage, see ``shards.py``); storage's pass.

Apart from ``shards.py`` because it is a unit of its own: what a download does on disk, and how a
cancel lets a pool thread's disk work end before its descriptor is closed (``_finish``).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any, Awaitable, Callable

from . import files
from ..io.blocking import to_the_end
from .evict import default_budget
from .lock import PeerLocks


# ----- downloads under way -----
# Reads served from a shard's download while it is still under way in this process.
#
# A shard is downloaded whole before it is installed, but a chunk of it need not wait for the
# rest: the cold epoch would decode nothing of a shard until its last byte came (the issue measured
# the cache's cold epoch at 0.88x of no cache). So each download of this process publishes how far
# its file is written, and a read whose bytes are all written reads them from that file at once
# (from the page cache: the bytes it was just given). Those bytes count as read from storage
# (no kept copy to blame if they fail to decode). Reads of a shard a peer process downloads wait
# for its copy, as before.

Finish = Callable[..., Awaitable[Any]]  # ShardCache._finish: thread work a cancel lets end first


class DownloadUnderway:
    """One download's file, open for reading, and how many of its first bytes are written."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.written = 0
        self.held: tuple[int, bytes] | None = None  # (start, bytes) of the chunk being written now
        self.done = False
        self._users = 0  # reads on a thread now: the descriptor is closed only after them

    async def read(self, start: int, end: int, finish: Finish) -> bytes:
        self._users += 1
        try:
            return await finish(os.pread, self.fd, end - start, start)
        finally:
            self._users -= 1
            self.close_if_unused()

    def close_if_unused(self) -> None:
        if self.done and not self._users and self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Downloads:
    """This process's downloads in progress, by URL, and a signal at each step of any of them."""

    def __init__(self) -> None:
        self._by_url: dict[str, DownloadUnderway] = {}
        self._changed: asyncio.Future | None = None

    def start(self, url: str, fd: int) -> DownloadUnderway:
        underway = self._by_url[url] = DownloadUnderway(fd)
        self._notify()
        return underway

    def hold(self, underway: DownloadUnderway, start: int, data: bytes) -> None:
        """``data``, downloaded from ``start``, is being written: reads within it need not wait
        for the disk (a busy one took seconds for a 16 MB write)."""
        underway.held = (start, data)
        self._notify()

    def advance(self, underway: DownloadUnderway, written: int) -> None:
        underway.written, underway.held = written, None
        self._notify()

    def end(self, url: str, underway: DownloadUnderway) -> None:
        if self._by_url.get(url) is underway:
            del self._by_url[url]
        underway.done = True
        underway.close_if_unused()
        self._notify()

    async def serve(self, url: str, start: int, end: int, ensuring: asyncio.Future, finish: Finish) -> bytes | None:
        """Bytes ``[start, end)`` of ``url`` from its download in progress, as soon as they are
        written; None once ``ensuring`` (the read's wait for the whole copy) ends first."""
        while not ensuring.done():
            underway = self._by_url.get(url)
            held = None if underway is None else underway.held
            if held is not None and held[0] <= start and end <= held[0] + len(held[1]):
                return held[1] if (start, end) == (held[0], held[0] + len(held[1])) else \
                    bytes(memoryview(held[1])[start - held[0]:end - held[0]])
            if underway is not None and underway.written >= end and underway.fd >= 0:
                return await underway.read(start, end, finish)
            loop = asyncio.get_running_loop()
            if self._changed is None or self._changed.get_loop() is not loop:
                self._changed = loop.create_future()
            await asyncio.wait({ensuring, self._changed}, return_when=asyncio.FIRST_COMPLETED)
        return None

    def _notify(self) -> None:
        if self._changed is not None:
            if not self._changed.done():
                self._changed.set_result(None)
            self._changed = None


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
        """``files.try_lock`` on the loop: a shard's lock is taken once per download."""
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
        underway = None
        try:
            await self._on_disk(files.reserve, fd, size)
            if self.streaming is not None:  # our own new file, open for the reads served from it
                underway = self.streaming.start(url, os.open(partial, files.READ_FLAGS))
            crc = 0
            for start in range(0, size, self.chunk_bytes):
                end = min(size, start + self.chunk_bytes)
                data = await self.download(url, start, end)
                if underway is not None:
                    self.streaming.hold(underway, start, data)  # type: ignore[union-attr]
                crc = await self._on_disk(files.write_all, fd, data, crc)
                if underway is not None:
                    self.streaming.advance(underway, end)  # type: ignore[union-attr]
            return crc
        finally:
            if underway is not None:
                self.streaming.end(url, underway)  # type: ignore[union-attr]
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
