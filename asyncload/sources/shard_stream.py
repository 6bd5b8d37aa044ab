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
from concurrent.futures import Future as ThreadFuture
from concurrent.futures import TimeoutError as FuturesTimeout
from typing import TYPE_CHECKING, Any

import numpy as np

from ..gates import AsyncGate
from ..cache import files
from ..cache.shards import ShardCache
from ..cache.items import KeptRead
from ..io.retries import RangeNotSatisfiable
from .shard_plan import Chunk, ChunkPlan
from .shards import ShardSample, ShardSource

if TYPE_CHECKING:
    from ..io.reader import Reader


THREAD_POLL_S = 0.5  # a decode thread waiting on the loop looks this often whether it still runs


class ShardTruncated(ValueError):
    """A shard is shorter than its index says (a ValueError: another try cannot fix it)."""


class MemberRead(KeptRead):
    """A sample of a shard whose cached copy this process knows current, read by the decode
    thread that decodes it (``read``: one open, pread and close of its own bytes), not through
    a chunk read and a task per sample on the loop: the warm epoch of a shard cache then costs
    less CPU per sample than reading the bucket (the loop's per-sample work was most of it)."""

    __slots__ = ("stream", "index", "chunk", "path", "size")

    def __init__(self, stream: "ShardStream", index: int, chunk: Chunk, path: Any, size: int) -> None:
        self.stream, self.index, self.chunk, self.path, self.size = stream, index, chunk, path, size

    def read(self) -> Any:
        """The sample as ``split_chunk`` cuts it; if the copy is gone or is not the one this
        process checked, the sample read again through the cache on the loop, waited for here."""
        source = self.stream.source
        start, end = int(source.sample_begin[self.index]), int(source.sample_end[self.index])
        try:
            read = files.read_checked_range(self.path, start, end, self.size)
        except OSError:
            return self.stream.read_from_thread(self.index)
        if read is None:  # replaced since this process checked it: the cache checks it again
            return self.stream.read_from_thread(self.index, replaced=self.chunk.url)
        if len(read[0]) < end - start:
            return self.stream.read_from_thread(self.index)
        data, self.chunk.copy = read  # what ``refetched`` checks if the sample fails to decode
        sample = source.split_chunk(memoryview(data), start, [self.index])[self.index]
        if isinstance(sample, BaseException):
            raise sample
        return sample


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

    With a cache, a sample whose chunk is not read yet and whose shard's copy the loader already
    knows current (an epoch after the one that checked it) is not read here at all: ``hit``
    hands the pipeline a ``MemberRead`` that the decode thread reads itself from the copy.
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
        self.direct: set[int] = set()  # chunks whose samples decode threads read from the copy (``hit``)
        self.loop: asyncio.AbstractEventLoop | None = None

    def hit(self, sample: Any) -> MemberRead | None:
        """On the loop: a ``MemberRead`` of ``sample`` if its chunk is not read (nor being read)
        and its shard's cached copy is known current, else None (``get`` serves it). A chunk
        served so is never read whole: its samples asked through ``get`` are read on their own."""
        if self.cache is None or self.run_blocking is not None or type(sample) is not ShardSample:
            return None
        index = sample.index
        number = int(self.chunk_of[index])
        if number < 0:
            return None
        chunk = self.chunks[number]
        if number not in self.direct and chunk.task is not None:
            return None
        size = int(self.source.shard_bytes[int(self.source.shard_of[index])])
        path = self.cache.kept_copy(chunk.url, size)
        if path is None:
            return None
        self.direct.add(number)
        self.loop = asyncio.get_running_loop()
        return MemberRead(self, index, chunk, path, size)

    def read_from_thread(self, index: int, replaced: str | None = None) -> Any:
        """``_read_again`` from a decode thread, for a ``MemberRead`` whose copy could not serve;
        ``replaced``: the shard whose copy is another file than the one this process checked,
        no longer known current (else ``ensure`` would serve the unchecked file without ever
        checking it, and every later pass would read each sample through the loop)."""
        loop = self.loop
        closing = f"{self.source[index]!r}: its cached shard cannot serve it and the loader is closing"
        try:
            future: ThreadFuture = asyncio.run_coroutine_threadsafe(self._read_replaced(index, replaced), loop)  # type: ignore[arg-type]
        except RuntimeError as error:  # the loop is closed
            raise RuntimeError(closing) from error
        while True:  # the read is bounded by the reader's timeouts; a loop stopped under it is not
            try:
                return future.result(timeout=THREAD_POLL_S)
            except FuturesTimeout:
                if loop is None or not loop.is_running():
                    future.cancel()
                    raise RuntimeError(closing) from None

    async def _read_replaced(self, index: int, replaced: str | None) -> Any:
        if replaced is not None and self.cache is not None:
            self.cache.forget(replaced, int(self.source.shard_bytes[int(self.source.shard_of[index])]))
        return await self._read_again(index)

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
        if number < 0 or number in self.direct:
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
            if self.started not in self.direct:  # else its samples are read on their own
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


def reader_shard_stream(source: ShardSource, plan: ChunkPlan, reader: Reader, concurrent_reads: int,
                        current: dict[str, float] | None = None) -> ShardStream:
    """A ``ShardStream`` of ``plan`` through ``reader``'s ranged reads, and through the disk
    cache for remote shards when the source has one (``current``: the copies the loader's last
    passes found current, see ``ShardCache``)."""
    cache = None
    sizes: dict[str, int] = {}
    if source.cache_dir is not None:
        sizes = dict(zip(source.urls, source.shard_bytes.tolist()))
        cache = ShardCache(source.cache_dir, source.cache_bytes, whole_or_failed(reader.read_range, sizes),
                           source.chunk_bytes, reader.run_blocking, version=reader.version, timeout=reader.timeout,
                           current=current)

    async def read_range(url: str, start: int, end: int) -> tuple[bytes, Any]:
        if cache is None or reader.is_local(url):
            return await reader.read_range(url, start, end), None
        return await cache.read_copy(url, start, end, sizes[url])

    return ShardStream(source, plan, read_range, concurrent_reads, cache=cache, run_blocking=reader.run_blocking)
