"""The disk cache of item sources (``image_folder``, ``list_files``, ``manifest`` on a bucket):
every object read once is kept whole in ``cache_dir``, so the next epochs (and runs) read it from
local disk and not a byte from the bucket.

It is the shard cache (``cache.py``) with each object as one "shard": the same folder and names
(``cache_files``), the same least-recently-used eviction under ``cache_bytes`` (``cache_evict``),
the same per-object locks shared by the processes and users of a node (``cache_lock``), the same
rules: no symlink followed, a copy checked against its checksum once per process (a damaged one is
downloaded again), a full disk or an unwritable folder sends reads to storage, a copy is served
while storage cannot be asked, and nothing the cache did not write is touched.

What differs is how a copy is known to be current. ``image_folder`` and ``list_files`` list the
bucket once when called, which gives every object's size and version (ETag): a copy is checked
against the listing, with no request. A manifest's items are not listed: the first read of each
in a process asks storage (one metadata request) for its size and version. Either way a copy,
once checked, is used unasked for the rest of the process's life, so epoch 2 sends no request.

Eviction scans the folder; with thousands of small objects a scan per download would cost more
than the downloads, so this process counts what it added and scans only when that may pass
``cache_bytes``, then frees ``SLACK`` of it more, so that the next scan is many downloads away;
and once at the end of a run, as the count can be short (a peer's copies; objects downloaded but
not yet on disk while a scan ran, whose total then replaced the count).
"""

from __future__ import annotations

import os
import zlib
from typing import Any, Callable

from . import cache_files as files
from .cache import ShardCache
from .cache_evict import evict_to, owned_bytes

WHOLE = 1 << 62  # the download's "chunk": an object is read in one GET
SLACK = 0.1  # an eviction frees this fraction of cache_bytes more than it must
RESCAN_FRACTION = 0.125  # peers add bytes too: scan again after adding this fraction of cache_bytes

Listed = Callable[[int], "tuple[int, str] | None"]  # source index -> (size, version) from the listing


class ItemChanged(Exception):
    """The object's size is not the one listed: it was rewritten since; read it uncached."""


class ItemCache(ShardCache):
    """``read(url, index)``: the bytes of the object at ``url`` (item ``index`` of the source),
    from its local copy, downloaded whole at its first read."""

    def __init__(self, directory: str, max_bytes: int | None, reader: Any, listed: Listed | None) -> None:
        self.reader = reader
        self.listed = listed
        self._known: dict[str, str] = {}  # url -> its version, from the listing or a metadata request
        self._sizes: dict[str, int] = {}  # unlisted urls checked in this process -> their size
        self._fresh: dict[str, bytes] = {}  # url -> the object just downloaded, for the read that asked
        self._added = 0  # bytes this process downloaded since its last scan of the folder
        self._estimate = 0  # the folder's bytes at the last scan, plus _added
        super().__init__(directory, max_bytes, self._get, WHOLE, reader.run_blocking,
                         version=self._version, timeout=reader.timeout)
        self.streaming = None  # an object is one read: it takes the bytes just downloaded (_fresh)
        if self._usable:
            self._estimate = _owned(self.directory)

    async def read(self, url: str, index: int) -> bytes:
        listed = self.listed(index) if self.listed is not None else None
        if self.reader.max_bytes is not None and listed is not None and listed[0] > self.reader.max_bytes:
            return await self.reader.read(url)  # too large to read: fails there, as uncached
        try:
            if listed is not None:
                size, self._known[url] = listed
            else:
                size = self._sizes.get(url)
                if size is None:
                    size = await self._size_of(url)
                    if size is None:
                        return await self.reader.read(url)  # storage down, no copy: its error
                    self._sizes[url] = size
            return (await self.read_copy(url, 0, size, size))[0]
        except ItemChanged:
            self._checked.pop(url, None)
            self._sizes.pop(url, None)
            return await self.reader.read(url)
        finally:
            self._known.pop(url, None)
            self._fresh.pop(url, None)  # a download whose install failed: not kept

    async def _from_copy(self, url: str, start: int, end: int, size: int) -> tuple[bytes, files.CopyId]:
        """The whole kept copy, its checksum checked at every read (30 us for 100 KB, against
        milliseconds to decode it): a copy damaged on disk is deleted and downloaded again, as
        no decode failure could tell whether the copy or the object is bad."""
        return await self.run_blocking(read_checked, files.shard_files(self.directory, url), size)

    async def _size_of(self, url: str) -> int | None:
        """An unlisted object's size: from a metadata request (its version is kept for the check
        that follows), else, while storage cannot be asked, from its kept copy's record."""
        version = await self._remote_version(url)
        if version is not None:
            self._known[url] = version
            return _size_in(version)
        meta = files.read_meta(files.shard_files(self.directory, url).meta)
        size = None if meta is None or meta.get("url") != url else meta.get("size")
        return size if isinstance(size, int) else None

    async def _version(self, url: str) -> str:
        known = self._known.get(url)
        return known if known is not None else await self.reader.version(url)

    async def _get(self, url: str, start: int, end: int) -> bytes:
        """The whole object (one GET, as uncached), which must be the ``end`` bytes expected."""
        data = await self.reader.read(url)
        if len(data) != end - start:
            raise ItemChanged(url)
        self._added += len(data)
        self._estimate += len(data)
        self._fresh[url] = data
        return data

    async def _fetch_to(self, url: str, size: int, partial: Any) -> int:
        """The object in one GET, written in one trip to a thread (a download per object: the
        shard cache's several trips cost the cold epoch a millisecond of CPU per object)."""
        data = await self.download(url, 0, size)
        return await self._on_disk(files.write_new, partial, data)

    async def _try_lock(self, path: Any) -> int | None:
        """On a thread: creating a lock file per object waits for the folder while the threads
        write copies into it (measured: 2 ms each, which stalled every read on the loop). A cancel
        lets the attempt end, and closes a lock it took."""
        return await self._finish(files.try_lock, path, undo=os.close)

    def _just_downloaded(self, url: str, start: int, end: int) -> bytes | None:
        return self._fresh.pop(url, None)

    async def _evict(self, room: int, scan: bool = False) -> None:
        """Scans (and evicts) only when this process's count says the folder may not have
        ``room``, or it added enough since its last scan that peers may have too, or ``scan``
        (the end of a run: the count misses peers' copies and those a scan overlapped)."""
        if not scan and self._estimate + room <= self.max_bytes \
                and self._added <= RESCAN_FRACTION * self.max_bytes and not self._over_size:
            return
        target = self.max_bytes - room - int(SLACK * self.max_bytes)
        try:
            self._estimate, self._over_size = await self.run_blocking(
                evict_to, self.directory, max(target, 0), self.max_bytes - room, set(self._in_use))
            self._added = 0
        except OSError as error:
            self._warn("evict", f"cannot evict: {error}")


def read_checked(names: files.ShardFiles, size: int) -> tuple[bytes, files.CopyId]:
    """The copy's bytes if they still have the checksum recorded at download; else the copy is
    deleted if damaged (``cache_files.recheck``) and FileNotFoundError says to download it again."""
    data, copy = files.read_copy_range(names.shard, 0, size, size)
    meta = files.read_meta(names.meta)
    if meta is not None and meta.get("size") == size and meta.get("crc32") == zlib.crc32(data):
        return data, copy
    files.recheck(names, size, copy)
    raise FileNotFoundError(f"{names.shard} does not hold what was downloaded")


def _size_in(version: str) -> int | None:
    """The size in ``Reader.version``'s answer (``size=<n> ...``)."""
    first = version.split(" ", 1)[0]
    try:
        return int(first[len("size="):]) if first.startswith("size=") else None
    except ValueError:
        return None


def _owned(directory: Any) -> int:
    try:
        return owned_bytes(directory)
    except OSError:
        return 0
