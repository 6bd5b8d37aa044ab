"""A local disk cache of remote shards, bounded in size, shared safely by the processes of one
machine (the ranks of a node, several jobs).

A shard is downloaded whole (large sequential ranged reads) into a temporary file and renamed
into place, so no process ever sees half a shard. A per-shard lock file (``flock``) lets one
process download while the others wait for its file instead of downloading it again. After each
download the least recently used shards are deleted until the cache fits ``max_bytes``, except
those this process is reading (the cache exceeds its size by those until they are released); a
shard another process deletes just before it is read is simply downloaded again (after three
such races in a row, the read goes straight to storage: the cache is too small for its users).

A kept shard is trusted only while it is what the URL holds: it must have the index's size and,
once per process and shard, the remote object's version (its ETag, else its modification time:
``version``) must equal the one recorded beside it at download, as fsspec's filecache does with
``check_files``. Partial downloads of a killed process (``.part`` files no process is writing, as
its shard's lock tells) are deleted by the next eviction; those being written count in the size.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import os
import posixpath
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, Awaitable, Callable

ReadRange = Callable[[str, int, int], Awaitable[bytes]]
Version = Callable[[str], Awaitable[str]]

LOCK_POLL_S = 0.05


class ShardCache:
    """``read_range(url, start, end, size)``: bytes of a remote shard, from the local copy."""

    def __init__(self, directory: str | os.PathLike, max_bytes: int, download: ReadRange, chunk_bytes: int,
                 run_blocking: Callable[..., Awaitable[Any]], version: Version | None = None) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.download = download  # async (url, start, end) -> bytes, retried by the reader
        self.chunk_bytes = chunk_bytes
        self.run_blocking = run_blocking  # runs file work off the event loop
        self.version = version  # async url -> the remote object's version (ETag or mtime), if known
        self._checked: dict[str, str] = {}  # url -> its version, checked against the kept copy this run
        self._downloads: dict[str, asyncio.Future] = {}  # this process's downloads in progress
        self._in_use: Counter[Path] = Counter()  # shards this process is reading: never evicted
        self._over_size = False  # the last eviction had to keep shards in use past max_bytes

    async def aclose(self) -> None:
        """Cancels this process's downloads (their partial files are removed), before the
        reader they use closes."""
        pending = list(self._downloads.values())
        for download in pending:
            download.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    def path(self, url: str) -> Path:
        """Where ``url`` is kept: its file name (for people looking at the folder) and a hash."""
        digest = hashlib.sha1(url.encode()).hexdigest()[:16]
        return self.directory / f"{digest}-{posixpath.basename(url)}"

    async def read_range(self, url: str, start: int, end: int, size: int) -> bytes:
        path = self.path(url)
        self._in_use[path] += 1
        try:
            for _ in range(3):  # evicted by another process between download and read: again
                await self.ensure(url, size)
                try:
                    return await self.run_blocking(_read_file_range, path, start, end)
                except FileNotFoundError:
                    continue
        finally:
            self._in_use[path] -= 1
            if not self._in_use[path]:
                del self._in_use[path]
                if self._over_size:
                    await self._evict()
        # Evicted by others between download and read three times: the cache is too small for
        # the processes sharing it. Serve the read from storage rather than fail it.
        return await self.download(url, start, end)

    async def ensure(self, url: str, size: int) -> Path:
        """The local copy of ``url`` (``size`` bytes), downloaded if no process has a current
        one yet (see the module on what current means)."""
        path = self.path(url)
        if url in self._checked and _touch(path, size):  # recently used: evicted last
            return path
        version = await self._remote_version(url)
        if _touch(path, size) and _recorded_version(path) == version:
            self._checked[url] = version
            return path
        pending = self._downloads.get(url)
        if pending is None:
            pending = self._downloads[url] = asyncio.ensure_future(self._download(url, size, path, version))
            pending.add_done_callback(lambda _: self._downloads.pop(url, None))
        await asyncio.shield(pending)
        self._checked[url] = version
        return path

    async def _remote_version(self, url: str) -> str:
        """The remote object's version; once per URL and run (one metadata request)."""
        if url in self._checked:
            return self._checked[url]
        return "" if self.version is None else await self.version(url)

    async def _download(self, url: str, size: int, path: Path, version: str) -> None:
        lock = await self.run_blocking(os.open, f"{path}.lock", os.O_CREAT | os.O_RDWR, 0o644)
        try:
            while not await self.run_blocking(_try_lock, lock):
                await asyncio.sleep(LOCK_POLL_S)  # another process downloads it: wait for its file
            if _touch(path, size) and _recorded_version(path) == version:
                return  # another process has just downloaded this version
            partial = path.with_name(f".{path.name}.{uuid.uuid4().hex}.part")
            try:
                await self._fetch_to(url, size, partial)
                os.replace(partial, path)
                # after the shard: a version seen beside an older file would make it trusted
                _version_path(path).write_text(json.dumps(version))
            finally:
                partial.unlink(missing_ok=True)
            await self._evict()
        finally:
            os.close(lock)  # also releases the flock

    async def _fetch_to(self, url: str, size: int, partial: Path) -> None:
        with open(partial, "wb") as file:
            for start in range(0, size, self.chunk_bytes):
                data = await self.download(url, start, min(size, start + self.chunk_bytes))
                await self.run_blocking(file.write, data)

    async def _evict(self) -> None:
        self._over_size = await self.run_blocking(_evict, self.directory, self.max_bytes, set(self._in_use))


def _evict(directory: Path, max_bytes: int, keep: set[Path]) -> bool:
    """Deletes the least recently used shards in ``directory`` but ``keep`` until the shards
    there fit ``max_bytes``; returns whether they still do not."""
    files = []
    partial_bytes = 0
    for entry in os.scandir(directory):
        if entry.name.endswith(".lock") or entry.name.endswith(".version"):
            continue
        try:
            stat = entry.stat()
        except FileNotFoundError:  # another eviction (this process's or another's) took it
            continue
        if entry.name.endswith(".part"):
            if not _remove_if_abandoned(Path(entry.path)):
                partial_bytes += stat.st_size  # a download under way: it will need the room
            continue
        if entry.name.startswith("."):
            continue
        files.append((stat.st_mtime, stat.st_size, Path(entry.path)))
    total = partial_bytes + sum(size for _, size, _ in files)
    for _, size, path in sorted(files):
        if total <= max_bytes:
            break
        if path not in keep:
            path.unlink(missing_ok=True)
            _version_path(path).unlink(missing_ok=True)
            total -= size
    return total > max_bytes


def _touch(path: Path, size: int) -> bool:
    """Marks ``path`` recently used; False if it is gone (another process may evict it at
    any moment: no exists-then-use) or is not ``size`` bytes (not the index's shard)."""
    try:
        os.utime(path)
        return os.stat(path).st_size == size
    except FileNotFoundError:
        return False


def _version_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.version")


def _recorded_version(path: Path) -> str | None:
    try:
        return json.loads(_version_path(path).read_text())
    except (FileNotFoundError, ValueError):
        return None


def _remove_if_abandoned(partial: Path) -> bool:
    """Deletes ``partial`` (``.<shard file>.<id>.part``) if no process is downloading its shard
    (nobody holds the shard's lock: its writer was killed); True if it did."""
    shard_name = partial.name[1:].rsplit(".", 2)[0]
    try:
        fd = os.open(partial.with_name(f"{shard_name}.lock"), os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        if not _try_lock(fd):
            return False
        partial.unlink(missing_ok=True)  # while holding the lock: no download can start on it
        return True
    finally:
        os.close(fd)


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _read_file_range(path: Path, start: int, end: int) -> bytes:
    with open(path, "rb") as file:
        return os.pread(file.fileno(), end - start, start)
