"""In a child process: fills rows of shared batch segments with the samples the parent names.

One event loop thread awaits remote reads; decode threads read local files, decode and write
each sample straight into its row. The parent plans the epoch; this module loads what a ``Fill``
lists and counts the rows, so a fill is one message in and one out.

A row is always finished by exactly one party: the loop task that reads it (if it fails or is
cancelled before its decode is queued) or the decode job (once queued). So when a run is
stopped, the ``Stopped`` answer is sent only once no thread can still write into its segments,
and the parent may reuse them. (Left to share with ``run/``: the row counting and ``rows.py``.)
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import cv2
import numpy as np
import torch

from ..autotune import AsyncGate, Gate
from ..batch.buffers import BatchBuffer, SampleLayout
from ..errors import SampleError
from ..io.cache import ShardCache
from ..io.reader import Reader
from ..sources.shard_stream import ShardStream
from ..run.jobs import labelled
from ..run.settings import split
from ..sources.shards import ShardSource
from ..stats.figures import LoaderStats
from .protocol import Done, Fill, Probe, Probed, Stopped, portable
from .rows import RowWriter, read_local

UNREAD = object()  # a row's data, before a decode thread reads it (a local file, or with read=False)


@dataclass
class Job:
    """One ``Fill`` being worked on."""

    fill: Fill
    buffer: BatchBuffer
    remaining: int
    failures: list[tuple[int, SampleError]] = field(default_factory=list)


class Filler:
    """The child's pipeline. ``fill``, ``probe``, ``stop`` and ``set_limits`` are called from the
    control thread; ``send`` (thread-safe) carries the answers to the parent."""

    def __init__(self, settings: dict[str, Any], send: Callable[[Any], None], stats: LoaderStats) -> None:
        self.s = settings
        self.source = settings["source"]
        self.decode = settings["decode"]
        self.send = send
        self.stats = stats
        self.writer = RowWriter(self.decode, stats)
        self.segments: dict[int, BatchBuffer] = {}
        self.gate = Gate(settings["thread_limit"]) if settings["thread_limit"] else None
        self.lock = threading.Lock()
        self.active: dict[int, int] = {}  # run -> fills not yet finished
        self.stopped: set[int] = set()
        self.started: set[int] = set()
        self.tasks: dict[int, set[asyncio.Task]] = {}
        cv2.setNumThreads(1)  # no native pool inside each decode thread (run/workers.py); our process
        self.pool = ThreadPoolExecutor(settings["num_threads"], thread_name_prefix="asyncload-decode",
                                       initializer=torch.set_num_threads, initargs=(1,))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="asyncload-loop", daemon=True)
        self.thread.start()
        self.reader: Reader = asyncio.run_coroutine_threadsafe(self._make_reader(), self.loop).result()
        self.slots = AsyncGate(settings["io_concurrency"])
        self.streams: set[ShardStream] = set()
        self.cache: ShardCache | None = None
        if isinstance(self.source, ShardSource) and self.source.cache_dir is not None:
            self.cache = ShardCache(self.source.cache_dir, self.source.cache_bytes, self.reader.read_range,
                                    self.source.chunk_bytes, self.reader.run_blocking)

    async def _make_reader(self) -> Reader:
        user_read = self.s["read"] if callable(self.s["read"]) else None
        return Reader(self.loop, storage_options=self.s["storage_options"], timeout=self.s["read_timeout"],
                      retries=self.s["read_retries"], io_concurrency=self.s["io_concurrency"], stats=self.stats,
                      user_read=user_read)

    # ----- the control thread -----

    def fill(self, message: Fill) -> None:
        self._run_started(message.run)
        job = Job(message, self.segments[message.segment], remaining=len(message.rows))
        with self.lock:
            self.active[message.run] = self.active.get(message.run, 0) + 1
        self.loop.call_soon_threadsafe(self._dispatch, job)

    def probe(self, message: Probe) -> None:
        self._run_started(message.run)
        asyncio.run_coroutine_threadsafe(self._probe(message), self.loop)

    def stop(self, run: int) -> None:
        """Drops the run's queued work; ``Stopped`` goes out once none of it is running."""
        with self.lock:
            self.stopped.add(run)
            idle = self.active.get(run, 0) == 0
        self.loop.call_soon_threadsafe(self._cancel, run)
        if run in self.started:
            self.started.discard(run)
            self.stats.run_stopped()
        if idle:
            self._finish_stop(run)

    def set_limits(self, num_threads: int | None, io_concurrency: int | None) -> None:
        if num_threads is not None and self.gate is not None:
            self.gate.set_limit(num_threads)
        if io_concurrency is not None:
            self.loop.call_soon_threadsafe(self._set_io, io_concurrency)

    def close(self) -> None:
        """Cancels reads, stops the loop and the threads; queued decodes are dropped."""
        async def shut() -> None:
            for run in list(self.tasks):
                self._cancel(run)
            for stream in list(self.streams):
                await stream.aclose()
            if self.cache is not None:
                await self.cache.aclose()
            await self.reader.aclose()

        try:
            asyncio.run_coroutine_threadsafe(shut(), self.loop).result(timeout=5)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=5)
            self.pool.shutdown(wait=False, cancel_futures=True)

    def _run_started(self, run: int) -> None:
        if run not in self.started and run not in self.stopped:
            self.started.add(run)
            self.stats.run_started()

    # ----- the event loop -----

    def _dispatch(self, job: Job) -> None:
        """Starts every row of a fill: local files and ``read=False`` items go straight to a
        decode thread; remote reads are awaited here first."""
        run = job.fill.run
        stream = None
        reads: list[asyncio.Task] = []
        if isinstance(self.source, ShardSource):
            stream = ShardStream(self.source, np.asarray(job.fill.indices), self._read_range(), self.s["io_concurrency"],
                                 cache=self.cache)
            self.streams.add(stream)
        for row, index in zip(job.fill.rows, job.fill.indices.tolist()):
            if run in self.stopped:
                self._row_done(job)
                continue
            try:
                key, label = split(self.source, self.s["labelled"], index)
            except SampleError as error:
                self._row_failed(job, row, error)
                continue
            if stream is None and (self.s["read"] is False or self.reader.is_local(key)):
                self.pool.submit(self._decode_row, job, row, key, UNREAD, label, index)
            else:
                reads.append(self._spawn(run, job, self._load(job, row, key, label, index, stream)))
        if stream is not None:
            self._spawn(run, None, self._close_stream_after(stream, reads))

    def _spawn(self, run: int, job: Job | None, coroutine: Any) -> asyncio.Task:
        task = self.loop.create_task(coroutine)
        tasks = self.tasks.setdefault(run, set())
        tasks.add(task)

        def done(task: asyncio.Task) -> None:
            tasks.discard(task)
            if task.cancelled() and job is not None:
                self._row_done(job)  # cancelled before its decode was queued: the row ends here

        task.add_done_callback(done)
        return task

    async def _load(self, job: Job, row: int, key: Any, label: int | None, index: int, stream: ShardStream | None) -> None:
        try:
            if stream is not None:
                data = await stream.get(key)
            else:
                await self.slots.acquire()
                try:
                    data = await self.reader.read(key)
                finally:
                    self.slots.release()
        except Exception as error:
            self._row_failed(job, row, SampleError(key, "read", error))
            return
        self.pool.submit(self._decode_row, job, row, key, data, label, index)  # the decode job ends the row

    async def _close_stream_after(self, stream: ShardStream, reads: list[asyncio.Task]) -> None:
        """Closes a fill's shard stream once its rows are read (or the run is stopped)."""
        try:
            await asyncio.gather(*reads, return_exceptions=True)
        finally:
            self.streams.discard(stream)
            await stream.aclose()

    def _read_range(self) -> Any:
        if self.cache is None:
            return self.reader.read_range
        sizes = dict(zip(self.source.urls, self.source.shard_bytes.tolist()))
        cache, reader = self.cache, self.reader

        async def read_range(url: str, start: int, end: int) -> bytes:
            if reader.is_local(url):
                return await reader.read_range(url, start, end)
            return await cache.read_range(url, start, end, sizes[url])

        return read_range

    def _cancel(self, run: int) -> None:
        for task in list(self.tasks.pop(run, ())):
            task.cancel()

    def _set_io(self, limit: int) -> None:
        self.slots.set_limit(limit)
        for stream in self.streams:
            stream.set_limit(limit)

    async def _probe(self, message: Probe) -> None:
        index = message.index
        key: Any = f"source[{index}]"
        try:
            key, label = split(self.source, self.s["labelled"], index)
            if isinstance(self.source, ShardSource):
                stream = ShardStream(self.source, np.array([index]), self._read_range(), 1, cache=self.cache)
                try:
                    data = await stream.get(key)
                finally:
                    await stream.aclose()
            elif self.s["read"] is False:
                data = key
            else:
                data = await self.reader.read(key)
        except SampleError as error:
            self.send(Probed(message.run, None, portable(error)))  # type: ignore[arg-type]
            return
        except Exception as error:
            self.send(Probed(message.run, None, portable(SampleError(key, "read", error))))  # type: ignore[arg-type]
            return
        try:
            sample = await self.loop.run_in_executor(self.pool, self.decode, data)
            layout = SampleLayout.of(labelled(sample, label))
        except Exception as error:
            self.send(Probed(message.run, None, portable(SampleError(key, "decode", error))))  # type: ignore[arg-type]
            return
        self.send(Probed(message.run, layout, None))

    # ----- any thread -----

    def _decode_row(self, job: Job, row: int, key: Any, data: Any, label: int | None, index: int) -> None:
        """On a decode thread: (read a local file,) decode, write the row; always ends the row."""
        try:
            if job.fill.run not in self.stopped:
                if data is UNREAD:  # a local file (or, with read=False, the item itself)
                    data = key if self.s["read"] is False else read_local(self.reader, key)
                if self.gate is None:
                    self.writer.write(job.buffer, row, key, data, label, (job.fill.epoch, index))
                else:
                    with self.gate:
                        self.writer.write(job.buffer, row, key, data, label, (job.fill.epoch, index))
        except SampleError as error:
            self._row_failed(job, row, error)
            return
        except Exception as error:
            self._row_failed(job, row, SampleError(key, "load", error))
            return
        self._row_done(job)

    def _row_failed(self, job: Job, row: int, error: SampleError) -> None:
        portable_error = portable(error)  # rare: worth its traceback note
        with self.lock:
            job.failures.append((row, portable_error))  # type: ignore[arg-type]
        self._row_done(job)

    def _row_done(self, job: Job) -> None:
        run = job.fill.run
        with self.lock:
            job.remaining -= 1
            if job.remaining:
                return
            self.active[run] -= 1
            stopped = run in self.stopped
            idle = self.active[run] == 0
        if not stopped:
            self.send(Done(run, job.fill.fill, job.failures))
        elif idle:
            self._finish_stop(run)

    def _finish_stop(self, run: int) -> None:
        with self.lock:
            self.active.pop(run, None)
        self.send(Stopped(run))

