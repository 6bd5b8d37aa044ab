"""Tar shards (WebDataset layout: ``key.jpg`` + ``key.cls`` ... in one ``.tar``) for storage that
charges per request: one large ranged read brings in hundreds of samples.

A shard set is described by an index (``index.json``, written by ``write_shards`` or
``index_shards``) that gives every sample's members as byte ranges of its shard. With it:

- the epoch order is known up front, from ``(seed, epoch)`` alone: the shard order is shuffled,
  each rank takes a contiguous part of that stream (equal lengths, ``DistributedSampler``'s
  padding and ``drop_last``), then a seeded shuffle buffer mixes samples across neighbouring
  shards. Because the order is a plain array of positions, resume, exactly-once delivery and the
  skip policy work as for single objects;
- reads follow that order: the samples still wanted are grouped into runs of neighbouring
  samples of a shard, each run one ranged read of up to ``chunk_bytes``, fetched from the event
  loop in the order the epoch needs them, the loader's ``io_concurrency`` at once (4 by
  default: each read is large). What is read ahead of the consumer is bounded by the
  shuffle buffer, as with a streaming shuffle buffer.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import posixpath
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..io import object_store
from ..autotune import AsyncGate
from ..order.sampler import EpochSampler
from .items import Source, checked_index

INDEX_NAME = "index.json"
INDEX_FORMAT = "asyncload-shards/1"
IMAGE_MEMBERS = ("jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff")
LABEL_MEMBER = "cls"


@dataclass(frozen=True)
class ShardSample:
    """Where one sample lives: its shard's URL, its key inside the shard, and its number in the
    shard set (storage order). Errors name it as ``shard-url#key``."""

    shard: str
    key: str
    index: int

    def __repr__(self) -> str:
        return repr(f"{self.shard}#{self.key}")


class ShardSource(Sequence):
    """The samples of a shard set, as ``(ShardSample, label)`` items when every sample has a
    ``.cls`` member, else ``ShardSample`` items. Build it with ``tar_shards(url)``.

    ``members="image"`` (default): a sample reads as the bytes of its image member, for
    ``ImageDecoder``; ``"all"``: as a dict ``{extension: bytes}`` of every member, for your own
    ``decode``. ``shuffle_buffer``: how many samples the shuffle mixes at once (memory: about that
    many encoded samples). ``chunk_bytes``: the largest single ranged read. ``cache_dir``: keep
    remote shards on local disk, at most ``cache_bytes`` (see ``cache.py``).
    """

    def __init__(
        self,
        index: dict[str, Any],
        base_url: str,
        *,
        storage_options: dict | None = None,
        members: str = "image",
        shuffle_buffer: int = 1000,
        chunk_bytes: int = 16 << 20,
        cache_dir: str | None = None,
        cache_bytes: int = 64 << 30,
    ) -> None:
        if index.get("format") != INDEX_FORMAT:
            raise ValueError(f"{base_url}: not an asyncload shard index (format {index.get('format')!r})")
        if members not in ("image", "all"):
            raise ValueError(f"members must be 'image' or 'all', got {members!r}")
        self.storage_options = storage_options
        self.members = members
        self.shuffle_buffer = max(1, shuffle_buffer)
        self.chunk_bytes = chunk_bytes
        self.cache_dir = cache_dir
        self.cache_bytes = cache_bytes
        self.classes = list(index.get("classes", []))
        self._read_index(index["shards"], base_url)

    def _read_index(self, shards: list[dict[str, Any]], base_url: str) -> None:
        """Flattens the index into arrays: a million samples cost tens of MB, not a GB of objects."""
        self.urls = [_join(base_url, shard["url"]) for shard in shards]
        self.shard_bytes = np.array([shard["bytes"] for shard in shards], dtype=np.int64)
        counts = [len(shard["keys"]) for shard in shards]
        self.shard_of = np.repeat(np.arange(len(shards), dtype=np.int32), counts)
        self.shard_first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.keys = Source(key for shard in shards for key in shard["keys"])  # one blob, not a list of str
        ext_ids: dict[str, int] = {}
        member_start, member_ext, member_offset, member_size = [0], [], [], []
        for shard in shards:
            for sample in shard["members"]:
                for ext, offset, size in sample:
                    member_ext.append(ext_ids.setdefault(ext, len(ext_ids)))
                    member_offset.append(offset)
                    member_size.append(size)
                member_start.append(len(member_ext))
        self.extensions: list[str] = list(ext_ids)
        self.member_start = np.array(member_start, dtype=np.int64)
        self.member_ext = np.array(member_ext, dtype=np.int16)
        self.member_offset = np.array(member_offset, dtype=np.int64)
        self.member_size = np.array(member_size, dtype=np.int64)
        labels = [label for shard in shards for label in shard.get("labels") or [None] * len(shard["keys"])]
        self.labels = None if any(label is None for label in labels) else np.array(labels, dtype=np.int64)
        ends = self.member_offset + self.member_size
        starts = self.member_start[:-1]
        self.sample_begin = np.minimum.reduceat(self.member_offset, starts) if len(starts) else np.zeros(0, np.int64)
        self.sample_end = np.maximum.reduceat(ends, starts) if len(starts) else np.zeros(0, np.int64)

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, index: int) -> Any:  # type: ignore[override]
        index = checked_index(index, len(self), "ShardSource")
        sample = ShardSample(self.urls[self.shard_of[index]], self.keys.url(index), index)
        return sample if self.labels is None else (sample, int(self.labels[index]))

    def __repr__(self) -> str:
        return f"ShardSource({len(self)} samples in {len(self.urls)} shards, {len(self.classes)} classes)"

    def sample_members(self, index: int) -> list[tuple[str, int, int]]:
        """``(extension, offset, size)`` of each member of sample ``index``."""
        members = range(self.member_start[index], self.member_start[index + 1])
        return [(self.extensions[self.member_ext[m]], int(self.member_offset[m]), int(self.member_size[m])) for m in members]

    def image_member(self, index: int) -> tuple[int, int]:
        """``(offset, size)`` of sample ``index``'s image member."""
        for ext, offset, size in self.sample_members(index):
            if ext in IMAGE_MEMBERS:
                return offset, size
        raise ValueError(f"sample {self[index]!r} has no image member ({', '.join(IMAGE_MEMBERS)})")


def _join(base_url: str, url: str) -> str:
    """A shard URL from the index: absolute as it is, else relative to the index's folder."""
    if "://" in url or url.startswith("/"):
        return url
    return posixpath.join(base_url, url)


def tar_shards(url: str, storage_options: dict | None = None, **options: Any) -> ShardSource:
    """The shard set whose index is ``url`` (an ``index.json``, or the folder or bucket prefix that
    holds one). ``options`` are ``ShardSource``'s: ``members``, ``shuffle_buffer``,
    ``chunk_bytes``, ``cache_dir``, ``cache_bytes``."""
    index_url = url if url.endswith(".json") else posixpath.join(url.rstrip("/"), INDEX_NAME)
    fs, path = object_store.url_to_fs(index_url, storage_options)
    try:
        index = json.loads(fs.cat_file(path))
    finally:
        object_store.release(fs)
    return ShardSource(index, posixpath.dirname(index_url), storage_options=storage_options, **options)


# ----- the order of an epoch -----


def buffer_shuffle(stream: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    """What a streaming shuffle buffer of ``size`` outputs for ``stream``: each step emits a
    random sample of the buffer and puts the next one of the stream in its place. So the sample
    at output position ``p`` was at most ``p + size`` samples into the stream: reading the stream
    in order, about ``size`` samples wait in memory."""
    values = stream.tolist()
    buffer = values[:size]
    picks = rng.random(len(values)).tolist()
    out = []
    upcoming = size
    for pick in picks:
        slot = int(pick * len(buffer))
        out.append(buffer[slot])
        if upcoming < len(values):
            buffer[slot] = values[upcoming]
            upcoming += 1
        else:
            buffer[slot] = buffer[-1]
            buffer.pop()
    return np.array(out, dtype=np.int64)


class ShardSampler(EpochSampler):
    """``EpochSampler`` for shards: each rank takes a contiguous part of the shard-ordered stream
    (so it reads few shards, not a slice of all of them), with the same lengths, padding and
    ``drop_last`` as ``DistributedSampler``; the shard order and the buffer shuffle come from
    ``(seed, epoch)`` (and the rank), the same on every machine."""

    def __init__(self, source: ShardSource, batch_size: int, **kwargs: Any) -> None:
        super().__init__(len(source), batch_size, **kwargs)
        self.source = source

    def identity(self) -> dict[str, Any]:
        """The base order's, plus what shapes a shard order: the shuffle buffer, the members
        read, and the shards' boundaries and URLs."""
        source = self.source
        layout = hashlib.sha256(np.ascontiguousarray(source.shard_first).tobytes())
        layout.update("\n".join(source.urls).encode())
        return {**super().identity(), "shuffle_buffer": source.shuffle_buffer, "members": source.members,
                "shards": layout.hexdigest()[:16]}

    def order(self, epoch: int) -> np.ndarray:
        source = self.source
        shards = np.arange(len(source.urls))
        if self.shuffle:
            shards = np.random.default_rng([self.seed, epoch]).permutation(shards)
        stream = np.concatenate([np.arange(source.shard_first[s], source.shard_first[s + 1]) for s in shards] or [[]])
        per_rank = self.samples_per_rank
        total = per_rank * self.world_size
        if total > len(stream) and len(stream) > 0:
            stream = np.resize(stream, total)  # pads by repeating from the start
        mine = stream[self.rank * per_rank : (self.rank + 1) * per_rank].astype(np.int64)
        if not self.shuffle:
            return mine
        rng = np.random.default_rng([self.seed, epoch, self.rank, 1])
        return buffer_shuffle(mine, source.shuffle_buffer, rng)


# ----- reading -----


@dataclass
class Chunk:
    """One ranged read: bytes ``[start, end)`` of shard ``url``, holding samples ``indices``."""

    url: str
    start: int
    end: int
    indices: list[int]
    task: asyncio.Task | None = None


def plan_chunks(source: ShardSource, wanted: np.ndarray, chunk_bytes: int) -> list[Chunk]:
    """Ranged reads for the samples ``wanted`` (sample numbers in the order the epoch needs them):
    shards in the order of their first need, and within a shard runs of neighbouring samples,
    each read at most ``chunk_bytes`` long (a sample larger than that is read alone)."""
    unique = np.flatnonzero(np.bincount(wanted, minlength=len(source)))  # ascending: storage order, so by shard
    shard_of = source.shard_of[unique]
    groups = np.split(unique, np.flatnonzero(np.diff(shard_of)) + 1) if len(unique) else []
    shards, first_need = np.unique(source.shard_of[wanted], return_index=True)
    group_of = dict(zip(shards.tolist(), groups))
    chunks: list[Chunk] = []
    for shard in shards[np.argsort(first_need, kind="stable")].tolist():
        indices = group_of[shard]
        breaks = np.flatnonzero(np.diff(indices) != 1) + 1
        for run in np.split(indices, breaks):
            chunks.extend(_split_run(source, shard, run, chunk_bytes))
    return chunks


def _split_run(source: ShardSource, shard: int, run: np.ndarray, chunk_bytes: int) -> list[Chunk]:
    chunks = []
    begin, end = source.sample_begin[run], source.sample_end[run]
    start = 0
    while start < len(run):
        stop = int(np.searchsorted(end, begin[start] + chunk_bytes, side="right"))
        stop = max(stop, start + 1)
        chunks.append(Chunk(source.urls[shard], int(begin[start]), int(end[stop - 1]), run[start:stop].tolist()))
        start = stop
    return chunks


class ShardTruncated(ValueError):
    """A shard is shorter than its index says (a ValueError: another try cannot fix it)."""


class ShardStream:
    """Serves one epoch run's samples from ranged reads of their shards, on the event loop.

    ``get(sample)`` starts the reads of the plan up to the chunk that holds the sample and
    ``concurrent_reads - 1`` chunks beyond it (so reads stay in the epoch's order, overlap, and
    run ahead of the epoch by a few chunks only), at most ``concurrent_reads`` at once, and waits
    for its bytes. ``set_limit`` changes ``concurrent_reads`` while the epoch runs (the tuner's
    ``io_concurrency``). Each sample's bytes are copied out of its chunk, so a sample that waits long
    in the shuffle does not keep a whole chunk alive. Per-sample bookkeeping is in arrays: a few
    bytes a sample, for millions of samples.

    A sample asked for beyond the plan is read again on its own, with one ranged read of its
    bytes: padding (a DDP rank that skipped samples repeats its first ones to deliver as many
    batches as the other ranks) may ask for a sample whose bytes were dropped at their last
    planned use, or, after a resume, for one delivered before and so left out of the plan.
    """

    def __init__(self, source: ShardSource, wanted: np.ndarray, read_range: Any, concurrent_reads: int = 4,
                 cache: Any = None) -> None:
        self.source = source
        self.read_range = read_range  # async (url, start, end) -> bytes
        self.cache = cache  # the ShardCache behind read_range, if any: its downloads end with us
        self.chunks = plan_chunks(source, wanted, source.chunk_bytes)
        self.chunk_of = np.full(len(source), -1, dtype=np.int64)
        for number, chunk in enumerate(self.chunks):
            self.chunk_of[chunk.indices] = number
        self.uses = np.bincount(wanted, minlength=len(source)).astype(np.int32)  # padding may repeat one
        self.started = 0
        self.slots = AsyncGate(concurrent_reads)
        self.ready: dict[int, Any] = {}  # sample -> bytes (or members), read and not yet taken
        self.failed: dict[int, BaseException] = {}
        self.waiting: dict[int, asyncio.Future] = {}

    async def get(self, sample: ShardSample) -> Any:
        index = sample.index
        if self._beyond_plan(index):
            return await self._read_again(index)
        self._start_through(int(self.chunk_of[index]) + self.slots.limit - 1)
        if index not in self.ready and index not in self.failed:
            future = self.waiting.get(index)
            if future is None:
                future = self.waiting[index] = asyncio.get_running_loop().create_future()
            await asyncio.shield(future)
        if index in self.failed:
            raise self.failed[index]
        return self._take(index)

    def _beyond_plan(self, index: int) -> bool:
        """Not in the plan, or in a chunk read already whose copy of the sample was taken."""
        number = int(self.chunk_of[index])
        if number < 0:
            return True
        task = self.chunks[number].task
        return task is not None and task.done() and index not in self.ready and index not in self.failed

    async def _read_again(self, index: int) -> Any:
        """One ranged read of sample ``index``'s own bytes (padding's repeat; see the class)."""
        url = self.source.urls[int(self.source.shard_of[index])]
        start, end = int(self.source.sample_begin[index]), int(self.source.sample_end[index])
        await self.slots.acquire()
        try:
            data = await self.read_range(url, start, end)
        finally:
            self.slots.release()
        if len(data) < end - start:
            raise ShardTruncated(f"{url} ends at byte {start + len(data)}, its index has a sample up to byte {end}")
        return self._members(memoryview(data), start, index)

    def _take(self, index: int) -> Any:
        self.uses[index] -= 1
        if self.uses[index] == 0:
            return self.ready.pop(index)
        return self.ready[index]

    def _start_through(self, number: int) -> None:
        while self.started <= min(number, len(self.chunks) - 1):
            chunk = self.chunks[self.started]
            chunk.task = asyncio.get_running_loop().create_task(self._fetch(chunk))
            self.started += 1

    async def _fetch(self, chunk: Chunk) -> None:
        try:
            await self.slots.acquire()
            try:
                data = await self.read_range(chunk.url, chunk.start, chunk.end)
            finally:
                self.slots.release()
            if len(data) < chunk.end - chunk.start:
                raise ShardTruncated(f"{chunk.url} ends at byte {chunk.start + len(data)}, its index has samples up to byte {chunk.end}")
            view = memoryview(data)
            samples = {index: self._members(view, chunk.start, index) for index in chunk.indices}
        except asyncio.CancelledError:
            raise
        except BaseException as error:
            for index in chunk.indices:
                self._settle(index, error=error)
            return
        for index, sample in samples.items():
            self._settle(index, sample)

    def _members(self, view: memoryview, base: int, index: int) -> Any:
        if self.source.members == "image":
            offset, size = self.source.image_member(index)
            return bytes(view[offset - base : offset - base + size])
        return {ext: bytes(view[offset - base : offset - base + size]) for ext, offset, size in self.source.sample_members(index)}

    def _settle(self, index: int, sample: Any = None, error: BaseException | None = None) -> None:
        if error is not None:
            self.failed[index] = error
        else:
            self.ready[index] = sample
        future = self.waiting.pop(index, None)
        if future is not None and not future.done():
            future.set_result(None)

    def set_limit(self, concurrent_reads: int) -> None:
        """Allows ``concurrent_reads`` reads at once from now on, and reading that far ahead."""
        self.slots.set_limit(concurrent_reads)

    async def aclose(self) -> None:
        """Cancels the reads in flight, then the cache's downloads (before the reader closes)."""
        tasks = [chunk.task for chunk in self.chunks[: self.started] if chunk.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.cache is not None:
            await self.cache.aclose()
