"""The disk cache of item sources (``image_folder``, ``list_files``, ``manifest`` on a bucket):
every object read once is kept whole in ``cache_dir``, so the next epochs (and runs) read it from
local disk and not a byte from the bucket.

The objects are packed into segment files (``item_files``: the format, the index, eviction),
not a file each: a file, a record and a lock per object cost the cold epoch more than half its
throughput. A read that misses downloads the object (one GET, as uncached) and hands it to the
batch being gathered (up to ``BATCH_OBJECTS`` or ``BATCH_BYTES``, for at most ``BATCH_WAIT_S``):
one trip to a thread and one ``pwritev`` for the lot, and each read returns once its object is on
disk, so a peer process that looks next finds it. A miss first looks at what peers wrote since
this process last looked (``SegmentStore.refresh``, shared by the misses waiting meanwhile; no
more than a ``stat`` of the folder, on the loop, while no peer writes: ``SegmentStore.quiet``; one
per turn of the loop, shared by the misses a fill starts together).
Two processes that miss the same object at once both download it (no per-object lock: the ranks
of a node read disjoint parts of an epoch); both copies are sound, the older ages out.

A loader's next pass builds a new ``ItemCache`` (a new loop and reader) on the ``KeptIndex`` of
its last one: the index and storage's answers about unlisted objects
outlive the pass, so the warm epoch neither parses the segments again nor asks storage again.

A hit costs no trip through the event loop: ``hit`` gives the pipeline a ``CopyRead`` that the
decode thread reads itself (``os.pread`` and a checksum); a copy it finds gone or damaged is read
through ``read`` again, on the loop, which downloads it. A copy found only once storage was asked
about it (a manifest's item, first read in this pass) is a ``CopyRead`` too (``fetch``): the loop
does not read and check its bytes.

How a copy is known to be current: ``image_folder`` and ``list_files`` list the bucket once, which
gives every object's size and version (ETag), checked against the copy's record with no request.
A manifest's items are not listed: the first read of each in a process asks storage (one metadata
request) for its size and version; then the copy is used unasked for the rest of the process's
life. While storage cannot be asked (a transient error after the retries), a copy whose checksum
holds is used for ``offline.OFFLINE_S`` without asking. A full disk or a folder that cannot be written
sends what is not kept to storage (one warning); nothing the cache did not write is touched.

Eviction: this process counts what the folder holds (its last scan plus its own writes) and, past
``cache_bytes``, deletes least recently used segments down to ``SLACK`` below it (one scan); it
scans again after adding ``RESCAN_FRACTION`` of ``cache_bytes`` (peers write too) and once at the
end of a run.
"""

from __future__ import annotations

import asyncio
import os
import threading
import warnings
from concurrent.futures import Future as ThreadFuture
from concurrent.futures import TimeoutError as FuturesTimeout
from pathlib import Path
from typing import Any, Awaitable, Callable

from ..io.blocking import to_the_end
from ..sources.items import Source
from ..sources.mix import MixedSource
from .evict import DEFAULT_CAP, FREE_FRACTION
from .item_files import CopyGone, Entry, SegmentStore, owned_bytes
from .offline import OfflineWindow

SLACK = 0.1  # an eviction frees this fraction of cache_bytes more than it must
RESCAN_FRACTION = 0.125  # peers add bytes too: scan again after adding this fraction of cache_bytes
SEGMENTS_PER_BUDGET = 8  # a segment is at most this fraction of cache_bytes: eviction stays fine-grained
BATCH_OBJECTS = 32  # a batch is written once it has this many objects...
BATCH_BYTES = 4 << 20  # ...or bytes...
BATCH_WAIT_S = 0.005  # ...or has waited this long for more (each read waits for its batch's write)
REFRESH_HITS = 4096  # hits between two looks at the folder (a peer's evicted segments are let go)
THREAD_POLL_S = 0.5  # a decode thread waiting on the loop looks this often whether it still runs
FINISH_S = 10.0  # how long closing waits for the write under way before giving up on what is left

Listed = Callable[[int], "tuple[int, str] | None"]  # source index -> (size, version) from the listing
_UNKNOWN = object()  # an unlisted object not yet asked about in this process

_warned: set[tuple[str, str]] = set()  # (folder, reason): each warned once per process


class KeptRead:
    """A kept copy that the decode thread decoding it reads itself (``read``): no trip through
    the loop per warm sample. The item cache's ``CopyRead``, and the shard cache's members
    (``sources/shard_stream.MemberRead``)."""

    __slots__ = ()

    def read(self) -> bytes:
        raise NotImplementedError


class CopyRead(KeptRead):
    """A hit, read by the decode thread that decodes it (``read``): no trip through the loop."""

    __slots__ = ("cache", "url", "index", "entry")

    def __init__(self, cache: "ItemCache", url: str, index: int, entry: Entry) -> None:
        self.cache, self.url, self.index, self.entry = cache, url, index, entry

    def read(self) -> bytes:
        """The copy's bytes; if it is gone or damaged, the object read again through the cache
        on the loop (downloaded), waited for here."""
        try:
            return self.cache.store.read(self.entry)
        except (CopyGone, OSError):
            return self.cache.read_from_thread(self.url, self.index, self.entry)


class KeptIndex:
    """What an item cache knows that outlives one pass (``KeptCaches``, below, keeps
    one per source and folder for a loader's next passes, each a new ``ItemCache`` on a new loop
    and reader): the segment store (its index: rebuilt, it was a parse of
    every record per pass), and each unlisted object's size and version as storage answered them
    (rebuilt, it was one metadata request per object per pass). ``busy`` while a cache uses it: a
    second loader on the same source at once gets an index of its own (the store's writes are
    serialised per cache, not across caches)."""

    def __init__(self, directory: str, max_bytes: int | None) -> None:
        self.directory = Path(directory)
        self.versions: dict[str, Any] = {}
        self.sizes: dict[str, int] = {}
        self.offline = OfflineWindow(lambda reason, message: _warn_once(self.directory, reason, message))
        self.busy = False
        self.closed = False
        self._lock = threading.Lock()  # busy and closed: the loader closes on its thread, a pass ends on its loop
        self.max_bytes = 0
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.max_bytes = max_bytes if max_bytes is not None else _default_budget(self.directory)
            self.store = SegmentStore(self.directory, self.max_bytes // SEGMENTS_PER_BUDGET)
            self.store.refresh()
            self.store.evict(self.max_bytes)  # a run that downloads nothing cleans up too
        except OSError as error:
            self.store = SegmentStore(self.directory, 1)
            _warn_once(self.directory, "folder", f"cannot use {error}; objects are read from storage")
            self.usable = False
        else:
            self.usable = True

    def claim(self) -> bool:
        """Whether a pass's cache may use this index now (then ``busy`` until ``release``)."""
        with self._lock:
            if self.busy or self.closed or not self.usable:
                return False
            self.busy = True
            return True

    def release(self) -> None:
        """The pass using it is over (its disk work done): closed now if the loader was."""
        with self._lock:
            self.busy = False
            if not self.closed:
                return
        self.store.close()

    def close(self) -> None:
        """Closes the store's descriptors (the loader is closed), or, while a pass still uses
        it (its stop timed out: its disk thread may be writing), lets that pass close it at its
        end: closed under a write, the writer's descriptor number went to the next file the
        process opened, and the write into that file."""
        with self._lock:
            self.closed = True
            if self.busy:
                return
        self.store.close()


class ItemCache:
    """``read(url, index)``: the bytes of the object at ``url`` (item ``index`` of the source),
    from its local copy, downloaded whole at its first read; ``hit(url, index)``: a ``CopyRead``
    when a current copy is known now."""

    def __init__(self, directory: str, max_bytes: int | None, reader: Any, listed: Listed | None,
                 kept: "KeptIndex | None" = None) -> None:
        self.directory = Path(directory)
        self.reader = reader
        self.listed = listed
        if kept is None or not kept.claim():
            kept = KeptIndex(str(directory), max_bytes)  # its own, closed with this cache
            kept.busy = True
            self._keep_open = False
        else:
            self._keep_open = True  # the next pass's cache finds the index and answers
        self.kept = kept
        self.max_bytes = kept.max_bytes
        self.store = kept.store
        self._versions = kept.versions  # unlisted url -> its version (None: offline, any will do)
        self._sizes = kept.sizes  # unlisted url -> its size, as asked
        self._offline = kept.offline  # storage could not be asked: copies used unasked
        self._usable = kept.usable
        self._pending: dict[str, tuple[str, bytes]] = {}  # downloaded, to be written in the next batch
        self._pending_bytes = 0
        self._next_write: asyncio.Future | None = None  # the write the pending objects go to
        self._writing: asyncio.Future | None = None  # the write under way
        self._batch_full: asyncio.Future | None = None  # set once the batch gathering is big enough
        self._refresh_wanted: asyncio.Future | None = None  # the refresh misses wait for
        self._refreshing = False
        self._looked = False  # the folder was looked at in this turn of the loop (``_refresh``)...
        self._stale = True  # ...and may hold what this process has not indexed
        self._disk = asyncio.Lock()  # one of refresh/append/evict at a time (bound to a loop at first use)
        self._added = 0  # bytes written since the last scan
        self._hits = 0
        self._background: asyncio.Future | None = None  # the last refresh started by hits
        self._writable = True

    # --- hits ---------------------------------------------------------------------------------

    def hit(self, url: str, index: int) -> CopyRead | None:
        """On the loop: a ``CopyRead`` of ``url``'s copy if one known now is current, else None
        (``read`` then serves it)."""
        if not self._usable:
            return None
        self._hits += 1
        if self._hits % REFRESH_HITS == 0:  # segments peers evicted: closed, so that their room is freed
            self._background = asyncio.ensure_future(self._refresh())
        entry = self.store.lookup(url)
        if entry is None or not self._current(url, index, entry) or \
                (self.reader.max_bytes is not None and entry.size > self.reader.max_bytes):
            return None
        return CopyRead(self, url, index, entry)

    def _current(self, url: str, index: int, entry: Entry) -> bool:
        listed = self.listed(index) if self.listed is not None else None
        if listed is not None:
            return entry.size == listed[0] and entry.version == listed[1]
        version = self._versions.get(url, _UNKNOWN)
        if version is _UNKNOWN:
            return False
        if version is None:  # storage could not be asked: any sound copy, for a while
            return self._offline.now()
        return entry.size == self._sizes.get(url) and entry.version == version

    def read_from_thread(self, url: str, index: int, gone: Entry) -> bytes:
        """``read`` from a decode thread, for a hit whose copy could not serve (``CopyRead``)."""
        self.store.forget(url, gone)
        loop = self.reader.loop
        try:
            future: ThreadFuture = asyncio.run_coroutine_threadsafe(self.read(url, index), loop)
        except RuntimeError as error:  # the loop is closed
            raise CopyGone(f"{url}: its cached copy is gone and the loader is closing") from error
        while True:  # the read is bounded by the reader's timeouts; a loop stopped under it is not
            try:
                return future.result(timeout=THREAD_POLL_S)
            except FuturesTimeout:
                if not loop.is_running():
                    future.cancel()
                    raise CopyGone(f"{url}: its cached copy is gone and the loader is closing") from None

    # --- misses -------------------------------------------------------------------------------

    async def read(self, url: str, index: int) -> bytes:
        """The object's bytes: its current copy, else downloaded (and kept)."""
        return await self.fetch(url, index, copy=False)  # type: ignore[return-value]  (no copy: bytes)

    async def fetch(self, url: str, index: int, copy: bool = True) -> "bytes | CopyRead":
        """``read``, but a current copy (with ``copy``) as a ``CopyRead`` that the decode thread
        reads: a pread and a checksum per warm item off the event loop."""
        listed = self.listed(index) if self.listed is not None else None
        if self.reader.max_bytes is not None and listed is not None and listed[0] > self.reader.max_bytes:
            return await self.reader.read(url)  # too large to read: fails there, as uncached
        if not self._usable:
            return await self.reader.read(url)
        if listed is not None:
            size, version = listed
        else:
            known = await self._ask(url)
            if known is None:
                return await self.reader.read(url)  # storage down, no copy: its error
            size, version = known
        pending = self._pending.get(url)
        if pending is not None and len(pending[1]) == size:
            return pending[1]
        for attempt in range(2):
            entry = self.store.lookup(url)
            if entry is not None and self._current(url, index, entry):
                if copy and (self.reader.max_bytes is None or entry.size <= self.reader.max_bytes):
                    return CopyRead(self, url, index, entry)
                try:
                    return self.store.read(entry)
                except (CopyGone, OSError):
                    self.store.forget(url, entry)
            if attempt == 0:
                await self._refresh()
        if version is None:  # no copy to fall back on: ask (and fail after the retries) anyway
            version = await self.reader.version(url)
            self._versions[url] = version
        data = await self.reader.read(url)
        if len(data) != size:
            self._sizes.pop(url, None)
            self._versions.pop(url, None)
            return data  # rewritten since it was listed (or asked about): read it uncached
        if self._writable:
            await self._keep(url, version, data)
        return data

    async def _ask(self, url: str) -> tuple[int, Any] | None:
        """An unlisted object's size and version: asked once per process (one metadata request),
        else, while storage cannot be asked, from its kept copy's record (version None)."""
        version = self._versions.get(url, _UNKNOWN)
        if version is not _UNKNOWN and (version is not None or self._offline.now()):
            return self._sizes[url], version
        answered, version = await self._offline.asked(url, lambda: self.reader.version(url))
        if answered:
            size = _size_in(version)
            if size is None:
                return None
            self._versions[url], self._sizes[url] = version, size
            return size, version
        entry = self.store.lookup(url)
        if entry is None:
            await self._refresh()
            entry = self.store.lookup(url)
        if entry is None:
            return None
        self._versions[url], self._sizes[url] = None, entry.size
        return entry.size, None

    async def _keep(self, url: str, version: str, data: bytes) -> None:
        """Adds the object to the next batch written, and returns once it is on disk (or the
        disk failed: then it is not kept, and the read still has its bytes)."""
        self._pending[url] = (version, data)
        self._pending_bytes += len(data)
        full = self._batch_full
        if full is not None and not full.done() and \
                (len(self._pending) >= BATCH_OBJECTS or self._pending_bytes >= BATCH_BYTES):
            full.set_result(None)
        if self._next_write is None:
            self._next_write = asyncio.get_running_loop().create_future()
        batch = self._next_write
        if self._writing is None:
            self._writing = asyncio.ensure_future(self._write_batches())
        await asyncio.shield(batch)

    async def _write_batches(self) -> None:
        """Writes the pending objects, a batch at a time, until none are left."""
        try:
            while self._pending:
                if len(self._pending) < BATCH_OBJECTS and self._pending_bytes < BATCH_BYTES:
                    # a thread trip per batch, not per object: the downloads just behind join it
                    self._batch_full = asyncio.get_running_loop().create_future()
                    await asyncio.wait([self._batch_full], timeout=BATCH_WAIT_S)
                    self._batch_full = None
                batch, done = self._pending, self._next_write
                self._pending, self._pending_bytes, self._next_write = {}, 0, None
                try:
                    if self._writable:
                        await self._on_disk(self._append, [(url, version, data) for url, (version, data) in batch.items()])
                except OSError as error:
                    self._writable = False
                    self._warn("write", f"cannot write {self.directory} ({error}): what is not kept is read "
                                        f"from storage")
                finally:
                    if done is not None and not done.done():
                        done.set_result(None)
        finally:
            self._writing = None
            if self._next_write is not None and not self._next_write.done():
                self._next_write.set_result(None)  # cancelled: its readers go on with their bytes
                self._next_write = None

    def _append(self, objects: list[tuple[str, str, bytes]]) -> None:
        """On a thread: the batch written, then an eviction if the count says the folder may
        pass ``cache_bytes`` (or enough was added that peers may have too)."""
        room = sum(len(data) for _, _, data in objects)
        if self.store.total + room > self.max_bytes:
            self.store.evict(max(0, self.max_bytes - room - int(SLACK * self.max_bytes)))
            self._added = 0
        self.store.append(objects)
        self._added += room
        if self.store.total > self.max_bytes or self._added > RESCAN_FRACTION * self.max_bytes:
            self.store.evict(max(0, self.max_bytes - int(SLACK * self.max_bytes)))
            self._added = 0

    async def _refresh(self) -> None:
        """Indexes what peers wrote since this process last looked: a refresh that starts after
        the call (one at a time; the misses that come while one runs share the next); none when
        the folder says nothing can have changed (``SegmentStore.quiet``: one ``stat`` here).
        The misses of one turn of the loop (a fill's reads start together) share one look: a
        ``stat`` of the folder per miss was a fifth of the cold epoch's extra time on the loop."""
        if not self._looked:
            self._looked = True
            asyncio.get_running_loop().call_soon(self._forget_look)
            try:
                self._stale = not self.store.quiet()
            except OSError:
                self._stale = True
        if not self._stale:
            return
        if self._refresh_wanted is None:
            self._refresh_wanted = asyncio.get_running_loop().create_future()
        wanted = self._refresh_wanted
        if not self._refreshing:
            self._refreshing = True
            asyncio.ensure_future(self._refreshes())
        await asyncio.shield(wanted)

    def _forget_look(self) -> None:
        self._looked = False

    async def _refreshes(self) -> None:
        try:
            while self._refresh_wanted is not None:
                wanted, self._refresh_wanted = self._refresh_wanted, None
                try:
                    await self._on_disk(self.store.refresh)
                except OSError as error:
                    self._warn("refresh", f"cannot scan: {error}")
                finally:
                    if not wanted.done():
                        wanted.set_result(None)
        finally:
            self._refreshing = False

    async def _on_disk(self, function: Callable[..., Any], *args: Any) -> Any:
        """``function(*args)`` on a reader thread, one at a time, let finish if the caller is
        cancelled (a thread cannot be stopped: the store must not be closed under it)."""
        async with self._disk:
            return await to_the_end(asyncio.ensure_future(self.reader.run_blocking(function, *args)))

    async def aclose(self) -> None:
        """Writes what is pending (for up to ``FINISH_S``), lets go of this process's segment,
        then scans and evicts whatever passes ``cache_bytes`` (the count may have missed a
        peer's writes). A kept index stays for the next pass; its descriptors are closed."""
        try:
            if not self._usable:
                return
            if self._background is not None:
                await asyncio.gather(self._background, return_exceptions=True)
            if self._writing is not None:
                writing = self._writing
                await asyncio.wait([writing], timeout=min(FINISH_S, self.reader.timeout))
                writing.cancel()
                await asyncio.gather(writing, return_exceptions=True)
            try:
                await self._on_disk(self._close_store)
            except OSError as error:
                self._warn("evict", f"cannot evict: {error}")
        finally:
            self.kept.release()  # after the disk work (``_on_disk`` lets it finish): the next pass may use it

    def _close_store(self) -> None:
        self.store.seal()
        try:
            self.store.evict(self.max_bytes)
        finally:
            if not self._keep_open:
                self.store.close()
            else:  # the index is kept for the next pass, not the descriptors (see ``close_descriptors``)
                self.store.close_descriptors()

    def _warn(self, reason: str, message: str) -> None:
        _warn_once(self.directory, reason, message)


def _warn_once(directory: Path, reason: str, message: str) -> None:
    if (str(directory), reason) not in _warned:
        _warned.add((str(directory), reason))
        warnings.warn(f"asyncload item cache {directory}: {message}", RuntimeWarning, stacklevel=3)


def _default_budget(directory: Path) -> int:
    """``DEFAULT_CAP``, or less: ``FREE_FRACTION`` of what the disk has free plus what the cache
    keeps already (a shared node's disk is not the cache's alone)."""
    disk = os.statvfs(directory)
    return min(DEFAULT_CAP, int(FREE_FRACTION * (disk.f_bavail * disk.f_frsize + owned_bytes(directory))))


def _size_in(version: str) -> int | None:
    """The size in ``Reader.version``'s answer (``size=<n> ...``)."""
    first = version.split(" ", 1)[0]
    try:
        return int(first[len("size="):]) if first.startswith("size=") else None
    except ValueError:
        return None


# ----- cached reads -----
# The item cache as the pipeline uses it: which items of a source (an ``image_folder``,
# ``list_files`` or ``manifest`` with ``cache_dir``, alone or mixed) are read through a disk cache
# (``ItemCache``, above), and closing those caches with the run. The one part of the cache that
# knows the sources (``sources/``); ``io/`` stays below them.

class CachedReads:
    """How the pipeline reads the items of a source with a ``cache_dir``: ``hit`` (a copy the
    decode thread reads itself) or ``read`` (an awaitable, on the loop); both None for an item
    not cached (a local file, a part of a mix without ``cache_dir``)."""

    def __init__(self, caches: dict[int, ItemCache], locate: Callable[[int], tuple[Any, int]], reader: Any) -> None:
        self.caches = caches
        self.locate = locate
        self.reader = reader

    def _cache(self, key: Any, index: int) -> tuple[ItemCache | None, int]:
        part, local = self.locate(index)
        cache = self.caches.get(id(part))
        if cache is None or not isinstance(key, str) or self.reader.is_local(key):
            return None, local
        return cache, local

    def hit(self, key: Any, index: int) -> CopyRead | None:
        cache, local = self._cache(key, index)
        return None if cache is None else cache.hit(key, local)

    def read(self, key: Any, index: int, copy: bool = True) -> Awaitable[bytes | CopyRead] | None:
        """The item's bytes, or (with ``copy``) a ``CopyRead`` of a current copy, for the decode
        thread to read."""
        cache, local = self._cache(key, index)
        return None if cache is None else cache.fetch(key, local, copy)

    async def aclose(self) -> None:
        """Writes what the caches hold still and lets go of their segments (before the reader closes)."""
        for cache in self.caches.values():
            await cache.aclose()


def item_cache(source: Any, reader: Any, kept: KeptCaches) -> CachedReads | None:
    """``CachedReads`` for ``source``, or None when no part of it has a ``cache_dir``. A mix's
    parts each keep their own cache, on what ``kept`` holds from the loader's last pass."""
    if isinstance(source, Source):
        parts, locate = [source], lambda index: (source, index)
    elif isinstance(source, MixedSource) and all(isinstance(p, Source) for p in source.sources):
        parts, locate = list(source.sources), lambda index: source.locate(index)[:2]
    else:
        return None
    caches = {id(p): ItemCache(p.cache_dir, p.cache_bytes, reader, p.listed if p.has_listing else None,
                               kept.item_index(p))
              for p in parts if getattr(p, "cache_dir", None) is not None}
    return CachedReads(caches, locate, reader) if caches else None


class KeptCaches:
    """What the caches of one loader's passes keep from one pass to the next in this process
    (``LocalPipeline`` builds a pipeline per pass, with a new loop and reader; a child's pipeline
    lives for all its passes): each item cache's ``KeptIndex`` (its index, open segments and
    storage's answers: rebuilt, a pass parsed every record and asked storage about every
    unlisted object again) and, per shard source, which copies are known current (rebuilt, a
    pass asked storage about every shard again and could not read its samples from the copies
    straight away). A new loader is a new run: it asks again. ``close`` with the loader."""

    def __init__(self) -> None:
        self.items: dict[tuple[int, str, int | None], KeptIndex] = {}  # (id of a source, cache_dir, cache_bytes)
        self.shards: dict[tuple[int, str], dict[str, float]] = {}  # (id of a source, cache_dir) -> url -> until

    def item_index(self, source: Source) -> KeptIndex:
        key = (id(source), str(source.cache_dir), source.cache_bytes)
        kept = self.items.get(key)
        if kept is None:
            kept = self.items[key] = KeptIndex(str(source.cache_dir), source.cache_bytes)
        return kept

    def shard_copies(self, source: Any) -> dict[str, float]:
        """``ShardCache``'s ``current`` for ``source``'s cache (see ``cache/shards.py``)."""
        return self.shards.setdefault((id(source), str(source.cache_dir)), {})

    def close(self) -> None:
        """Closes the kept segments' descriptors (a read still using one closes it after)."""
        for kept in self.items.values():
            kept.close()
        self.items.clear()
        self.shards.clear()
