"""A local disk cache of remote shards, bounded in size, shared safely by the processes of one
machine (the ranks of a node, several jobs).

A shard is downloaded whole (large sequential ranged reads) into a temporary file and renamed
into place, so no process ever sees half a shard. A per-shard lock file (``flock``) lets one
process download while the others wait for its file instead of downloading it again. After each
download the least recently used shards are deleted until the cache fits ``max_bytes``, except
those this process is reading (the cache exceeds its size by those until they are released); a
shard another process deletes just before it is read is simply downloaded again.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import os
import posixpath
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, Awaitable, Callable

ReadRange = Callable[[str, int, int], Awaitable[bytes]]

LOCK_POLL_S = 0.05


class ShardCache:
    """``read_range(url, start, end, size)``: bytes of a remote shard, from the local copy."""

    def __init__(self, directory: str | os.PathLike, max_bytes: int, download: ReadRange, chunk_bytes: int,
                 run_blocking: Callable[..., Awaitable[Any]]) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.download = download  # async (url, start, end) -> bytes, retried by the reader
        self.chunk_bytes = chunk_bytes
        self.run_blocking = run_blocking  # runs file work off the event loop
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
        raise FileNotFoundError(f"{url}: the cached copy keeps being evicted by other processes; raise cache_bytes")

    async def ensure(self, url: str, size: int) -> Path:
        """The local copy of ``url`` (``size`` bytes), downloaded if no process has it yet."""
        path = self.path(url)
        if path.exists():
            os.utime(path)  # recently used: evicted last
            return path
        pending = self._downloads.get(url)
        if pending is None:
            pending = self._downloads[url] = asyncio.ensure_future(self._download(url, size, path))
            pending.add_done_callback(lambda _: self._downloads.pop(url, None))
        await asyncio.shield(pending)
        return path

    async def _download(self, url: str, size: int, path: Path) -> None:
        lock = await self.run_blocking(os.open, f"{path}.lock", os.O_CREAT | os.O_RDWR, 0o644)
        try:
            while not await self.run_blocking(_try_lock, lock):
                await asyncio.sleep(LOCK_POLL_S)  # another process downloads it: wait for its file
            if path.exists():
                return
            partial = path.with_name(f".{path.name}.{uuid.uuid4().hex}.part")
            try:
                await self._fetch_to(url, size, partial)
                os.replace(partial, path)
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
    for entry in os.scandir(directory):
        if entry.name.startswith(".") or entry.name.endswith(".lock"):
            continue
        try:
            stat = entry.stat()
        except FileNotFoundError:  # another eviction (this process's or another's) took it
            continue
        files.append((stat.st_mtime, stat.st_size, Path(entry.path)))
    total = sum(size for _, size, _ in files)
    for _, size, path in sorted(files):
        if total <= max_bytes:
            break
        if path not in keep:
            path.unlink(missing_ok=True)
            total -= size
    return total > max_bytes


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _read_file_range(path: Path, start: int, end: int) -> bytes:
    with open(path, "rb") as file:
        return os.pread(file.fileno(), end - start, start)
