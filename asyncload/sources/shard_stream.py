"""Reading tar shards in the order an epoch needs them: the samples still wanted are grouped
into runs of neighbouring samples of a shard, each run one ranged read of up to ``chunk_bytes``,
fetched from the event loop a few at once; what is read ahead of the consumer is bounded by the
shuffle buffer.

The driver plans a run's reads once (``shard_plan.plan_reads``); with ``processes=N`` each chunk
is owned by one process (``ChunkPlan.owned``) and the driver sends every sample to its chunk's
owner, so a run makes the same ranged reads whatever the number of processes.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import numpy as np

from ..gates import AsyncGate
from ..io.cache import ShardCache
from ..io.retries import RangeNotSatisfiable
from .shard_plan import Chunk, ChunkPlan
from .shards import ShardSample, ShardSource

if TYPE_CHECKING:
    from ..io.reader import Reader


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

    Bytes read from a cached copy that fail (a chunk that does not parse here, a sample that does
    not decode: ``refetched``) may be the copy's fault, damaged on disk after the cache checked
    it: the cache checks it again (``ShardCache.damaged``) and, if it was damaged, they are read
    once more from a fresh download; else the failure stands. Only failures pay for this.
    """

    def __init__(self, source: ShardSource, plan: ChunkPlan, read_range: Any, concurrent_reads: int = 4,
                 cache: Any = None, run_blocking: Any = None) -> None:
        self.source = source
        self.read_range = read_range  # async (url, start, end) -> (bytes, cached copy they came from or None)
        # where a source that parses a whole shard (Parquet) does it: off the loop, which a
        # row group's parse (tens of ms) would otherwise stall; tar's cuts stay on the loop
        self.run_blocking = run_blocking if getattr(source, "read_whole", False) else None
        self.cache = cache  # the ShardCache behind read_range, if any: its downloads end with us
        self.chunks = plan.chunks
        self.chunk_of = np.full(len(source), -1, dtype=np.int32)
        for number, chunk in enumerate(self.chunks):
            self.chunk_of[chunk.indices] = number
        self.repeats = dict(plan.repeats)  # samples wanted again after their first use: how often more
        self.started = 0
        self.slots = AsyncGate(concurrent_reads)
        self.ready: dict[int, Any] = {}  # sample -> bytes (or members), read and not yet taken
        self.failed: dict[int, BaseException] = {}
        self.waiting: dict[int, asyncio.Future] = {}
        self.refetched_samples: set[int] = set()  # decoded again once already: a failure now stands

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
            data, _ = await self.read_range(url, start, end)
        finally:
            self.slots.release()
        if len(data) < end - start:
            raise ShardTruncated(f"{url} ends at byte {start + len(data)}, its index has a sample up to byte {end}")
        sample = self.source.split_chunk(memoryview(data), start, [index])[index]
        if isinstance(sample, BaseException):
            raise sample
        return sample

    async def refetched(self, index: int) -> Any:
        """Sample ``index`` read again, once, after its decode failed, if the bytes came from a
        cached copy that turned out damaged (see the class); None: the failure stands."""
        number = int(self.chunk_of[index])
        if self.cache is None or number < 0 or index in self.refetched_samples:
            return None
        self.refetched_samples.add(index)
        if not await self._copy_damaged(self.chunks[number]):
            return None
        return await self._read_again(index)

    async def _copy_damaged(self, chunk: Chunk) -> bool:
        if chunk.copy is None or self.cache is None:
            return False
        size = int(self.source.shard_bytes[int(self.source.shard_of[chunk.indices[0]])])
        return await self.cache.damaged(chunk.url, size, chunk.copy)

    def _take(self, index: int) -> Any:
        more = self.repeats.get(index, 1) - 1
        if more <= 0:
            self.repeats.pop(index, None)
            return self.ready.pop(index)
        self.repeats[index] = more
        return self.ready[index]

    def _start_through(self, number: int) -> None:
        while self.started <= min(number, len(self.chunks) - 1):
            chunk = self.chunks[self.started]
            chunk.task = asyncio.get_running_loop().create_task(self._fetch(chunk))
            self.started += 1

    async def _fetch(self, chunk: Chunk) -> None:
        try:
            try:
                samples = await self._read_chunk(chunk)
            except Exception:
                if not await self._copy_damaged(chunk):
                    raise
                samples = await self._read_chunk(chunk)  # from a fresh download, once
        except asyncio.CancelledError:
            raise
        except BaseException as error:
            for index in chunk.indices:
                self._settle(index, error=error)
            return
        for index, sample in samples.items():
            if isinstance(sample, BaseException):  # the source's verdict on this sample alone
                self._settle(index, error=sample)
            else:
                self._settle(index, sample)

    async def _read_chunk(self, chunk: Chunk) -> dict[int, Any]:
        await self.slots.acquire()
        try:
            data, chunk.copy = await self.read_range(chunk.url, chunk.start, chunk.end)
        finally:
            self.slots.release()
        if len(data) < chunk.end - chunk.start:
            raise ShardTruncated(f"{chunk.url} ends at byte {chunk.start + len(data)}, its index has samples up to byte {chunk.end}")
        if self.run_blocking is not None:
            return await self.run_blocking(self.source.split_chunk, memoryview(data), chunk.start, chunk.indices)
        return self.source.split_chunk(memoryview(data), chunk.start, chunk.indices)

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


def whole_or_failed(read_range: Any, sizes: dict[str, int]) -> Any:
    """``read_range`` for the disk cache's downloads: a read that meets the shard's end before
    its index's ``bytes`` fails with ``ShardTruncated`` (the cache then keeps no copy of that
    shard and reads it from storage for the rest of the run, so a short shard is not downloaded
    again for every chunk read from it). Each sample succeeds or fails on its own bytes."""

    async def read(url: str, start: int, end: int) -> bytes:
        try:
            data = await read_range(url, start, end)
        except RangeNotSatisfiable:
            data = b""  # it ends at or before start
        if len(data) < end - start:
            raise ShardTruncated(f"{url} ends {'at' if data else 'at or before'} byte {start + len(data)}, "
                                 f"but its index says it holds {sizes[url]} bytes (field 'bytes')")
        return data

    return read


def reader_shard_stream(source: ShardSource, plan: ChunkPlan, reader: Reader, concurrent_reads: int) -> ShardStream:
    """A ``ShardStream`` of ``plan`` through ``reader``'s ranged reads, and through the disk
    cache for remote shards when the source has one."""
    cache = None
    sizes: dict[str, int] = {}
    if source.cache_dir is not None:
        sizes = dict(zip(source.urls, source.shard_bytes.tolist()))
        cache = ShardCache(source.cache_dir, source.cache_bytes, whole_or_failed(reader.read_range, sizes),
                           source.chunk_bytes, reader.run_blocking, version=reader.version, timeout=reader.timeout)

    async def read_range(url: str, start: int, end: int) -> tuple[bytes, Any]:
        if cache is None or reader.is_local(url):
            return await reader.read_range(url, start, end), None
        return await cache.read_copy(url, start, end, sizes[url])

    return ShardStream(source, plan, read_range, concurrent_reads, cache=cache, run_blocking=reader.run_blocking)
