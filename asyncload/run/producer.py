"""The producer: on the run's event loop, takes batches from the plan, issues their reads and
hands rows to the decode jobs; a sample that fails goes through the plan's failure policy.

Batches take the epoch's positions from the plan, ``batch_size`` at a time, at most ``prefetch``
ahead of the user. Local files go to the decode threads by chunks (each job reads and decodes its
rows: no hand-off back to the loop per sample); other items are read here, at most
``io_concurrency`` in flight, then decoded one job each. A sample that fails either fails its
batch (``on_error="raise"``) or (``"skip"``) is recorded and its row is given the plan's next
position, so batches stay full. A batched decoder's rows (``batched.py``) wait until none of
their batch's is still being read, then go to one ``decode_batch`` job.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable, Sequence

from ..autotune import AsyncGate
from ..batch.buffers import SampleLayout
from ..errors import SampleError
from ..io.reader import Reader
from ..sources.shard_stream import ShardStream, reader_shard_stream
from ..sources.shards import ShardSource
from .batched import BatchJobs, is_batched
from .board import Board
from .jobs import Batch, Row, RowFiller, RowJobs, chunk_rows, labelled, local_path
from .plan import EpochPlan
from .settings import Settings, split
from .workers import DecodeWorkers


class Producer:
    """The loop side of one run: reads, decode jobs, failures, complete batches to ``board``."""

    def __init__(self, settings: Settings, epoch: int, plan: EpochPlan, board: Board,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.s = settings
        self.plan = plan
        self.order = plan.order
        self.board = board
        self.loop = loop
        # What a shard run reads: the rest of the epoch (taken now, on the user's thread).
        self._undelivered = plan.undelivered() if isinstance(settings.source, ShardSource) else None
        self.workers = DecodeWorkers(settings.num_threads, settings.thread_gate)
        self.filler = RowFiller(settings.decode, epoch, settings.stats, self._read_other, self.rows_done, self._job_failed)
        self.jobs = (BatchJobs if is_batched(settings.decode) else RowJobs)(self.filler, self._run_job)
        self._chunk = chunk_rows(settings.batch_size, settings.num_threads)
        self.in_pipeline: list[Batch] = []  # batches taken from the ring and not handed out
        self.skipped_early: list[int] = []  # skipped while the layout was learnt: go with the first batch
        self.stopped = False  # nothing new starts
        self.room = asyncio.Event()  # set when a batch leaves the pipeline
        self._all_complete = asyncio.Event()  # the loop stays up until then: failures need it
        self._read_slots = AsyncGate(self._sample_slots(settings))
        self._shards: ShardStream | None = None  # a shard source's reads, made on the loop
        self._reader: Reader | None = None
        self._tasks: set[asyncio.Task] = set()
        self._rows_lock = threading.Lock()

    @staticmethod
    def _sample_slots(settings: Settings) -> int:
        """Samples whose read may be under way at once. With tar shards the reads are the shard
        stream's ranged chunk reads, which ``io_concurrency`` caps there; a sample only waits for
        its chunk, and the prefetch window bounds how many do."""
        if isinstance(settings.source, ShardSource):
            return settings.batch_size * settings.prefetch
        return settings.io_concurrency

    async def produce_all(self) -> None:
        """The run's main task: every batch, then every failure's replacement, then closing."""
        reader = Reader(self.loop, storage_options=self.s.storage_options, timeout=self.s.read_timeout,
                        retries=self.s.read_retries, io_concurrency=self.s.io_concurrency, stats=self.s.stats,
                        user_read=self.s.read if callable(self.s.read) else None)
        self._reader = reader
        if isinstance(self.s.source, ShardSource):
            assert self._undelivered is not None
            self._shards = reader_shard_stream(self.s.source, self._undelivered, reader, self.s.io_concurrency)
        try:
            await self._produce()
            await self._all_complete.wait()
            while self._tasks:  # failures may add replacements meanwhile
                await asyncio.gather(*list(self._tasks), return_exceptions=True)
        finally:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            try:
                if self._shards is not None:
                    await self._shards.aclose()
            finally:
                await reader.aclose()

    async def _produce(self) -> None:
        """Issues every sample's load, batch by batch in order, at most ``prefetch`` batches
        ahead of the user."""
        number = 0
        first_sample = None
        while True:
            if number - self.board.handed_out >= self.s.prefetch:
                await self._wait_for_room(number)
            positions = self.plan.take_batch(number)
            if not positions:
                break
            if self.s.ring.layout is None:
                first_sample = await self._learn_layout(number, positions)
                if first_sample is None:
                    break
            batch = Batch(number, positions, self.s.ring.take(), remaining=len(positions))
            self.in_pipeline.append(batch)
            number += 1
            rows = range(len(positions))
            if first_sample is not None:  # row 0 of the first batch: already decoded
                self.workers.submit(lambda b=batch, s=first_sample: self.filler.write_job(b, 0, s[1], s[0]))
                first_sample, rows = None, range(1, len(positions))
            await self._submit(batch, rows)
        if self.board.planned(number):
            self._all_complete.set()

    async def _wait_for_room(self, number: int) -> None:
        """Waits until fewer than ``prefetch`` batches are ahead of the user."""
        self.s.stats.level("producer_waiting", 1)
        try:
            while number - self.board.handed_out >= self.s.prefetch:
                self.room.clear()
                await self.room.wait()
        finally:
            self.s.stats.level("producer_waiting", -1)

    def _spawn(self, coroutine: Any) -> bool:
        """Runs ``coroutine`` as a task of this run; once the run is stopped nothing starts (a
        late failure of a local read would otherwise leave a task the closing loop never runs)
        and False says so: what the coroutine would have released, the caller releases."""
        if self.stopped:
            coroutine.close()
            return False
        task = self.loop.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    async def _learn_layout(self, number: int, positions: list[int]) -> tuple[Any, Any] | None:
        """Loads the epoch's first sample to learn the batch layout from it; returns its key and
        labelled sample, to be written into its row without a second read. A sample that fails
        is skipped (its position replaced) or fails the batch; then None is returned."""
        while True:
            index = int(self.order[positions[0]])
            key: Any = f"source[{index}]"
            try:
                key, label = self._split(index)
                data = await self._fetch(key)
                sample = await self.workers.run_async(self.loop, self.filler.timed_decode, data)
                break
            except Exception as error:
                failure = self.plan.record(positions[0], error if isinstance(error, SampleError) else SampleError(key, "decode", error))
                if failure is not None:
                    self._finish(Batch(number, positions, None, 0, {0: failure}))
                    return None
                self.skipped_early.append(positions[0])
                replacement = self.plan.replacement()
                if replacement is not None:
                    positions[0] = replacement
                    continue
                del positions[0]  # the epoch has no sample left to replace it: the batch is one shorter
                if not positions:
                    return None  # every remaining sample failed and was skipped
        sample = labelled(sample, label)
        self.s.ring.configure(SampleLayout.of(sample), self.s.batch_size)
        return key, sample

    def _split(self, index: int) -> tuple[Any, int | None]:
        """The source item at ``index`` -> (what to read, label or None)."""
        return split(self.s.source, self.s.labelled, index)

    async def _fetch(self, key: Any) -> Any:
        if self.s.read is False:
            return key
        try:
            if self._shards is not None:
                return await self._shards.get(key)
            return await self._reader.read(key)
        except Exception as error:
            raise SampleError(key, "read", error) from error

    async def _submit(self, batch: Batch, rows: Sequence[int]) -> None:
        """Starts the loads of ``rows`` of ``batch``: local files by chunks of rows, each a
        decode job that reads them itself; others read here, one decode job each. A batched
        decoder's rows wait while the batch is held (here and by each read), then make one job."""
        self.jobs.hold(batch)
        try:
            local: list[Row] = []
            for row in rows:
                index = int(self.order[batch.positions[row]])
                try:
                    key, label = self._split(index)
                except SampleError as error:
                    await self._failed(batch, row, error)
                    continue
                if self._is_local(key):
                    local.append(Row(row, key, label, index))
                    if len(local) == self._chunk:
                        self.jobs.add(batch, local)
                        local = []
                else:
                    await self._read_slots.acquire()
                    self.jobs.hold(batch)  # released by _load
                    if not self._spawn(self._load(batch, Row(row, key, label, index))):
                        self._read_slots.release()
                        self.jobs.release(batch)
            if local:
                self.jobs.add(batch, local)
        finally:
            self.jobs.release(batch)

    def _run_job(self, job: Callable[[], None]) -> None:
        if not self.stopped:
            self.workers.submit(job)

    def _is_local(self, key: Any) -> bool:
        """Whether a decode thread reads ``key`` itself: local files, with the loader's own read."""
        if self.s.read is not None or self._shards is not None:
            return False
        assert self._reader is not None
        return local_path(key) is not None or self._reader.is_local(key)

    def _read_other(self, key: str) -> bytes:
        """On a decode thread: a local URL that is not a plain path to a regular file (e.g.
        ``memory://``, a FIFO), read with the reader's timeout."""
        assert self._reader is not None
        self._reader.is_local(key)  # finds (and caches) the URL's filesystem, which read_local uses
        return self._reader.read_local(key)

    async def _load(self, batch: Batch, row: Row) -> None:
        """Reads a sample on the loop, then hands it to a decode job; a failed read takes the
        failure path, so the row is always completed."""
        try:
            try:
                row.data = await self._fetch(row.key)
            finally:
                self._read_slots.release()
        except SampleError as error:
            await self._failed(batch, row.row, error)
        except Exception as error:  # not the sample's fault, but it must not be lost either
            await self._failed(batch, row.row, SampleError(f"source[{row.index}]", "load", error))
        else:
            self.jobs.add(batch, [row])
        finally:
            self.jobs.release(batch)

    def _job_failed(self, batch: Batch, row: int, error: SampleError) -> None:
        """On a decode thread: a row failed. The failure policy may take the plan's next
        position, which the loop owns: run it there."""
        call_in_loop(self.loop, lambda: self._spawn(self._failed(batch, row, error)))

    def set_io_limit(self, limit: int) -> None:
        """Changes how many reads may be in flight, on the loop."""
        (self._read_slots if self._shards is None else self._shards).set_limit(limit)

    async def _failed(self, batch: Batch, row: int, error: SampleError) -> None:
        """A sample failed. Raising: its batch carries the error. Skipping: the row gets the
        epoch's next position, or becomes a hole if the epoch has none left."""
        failure = self.plan.record(batch.positions[row], error)
        if failure is not None:
            batch.errors[row] = failure
        else:
            batch.skipped.append(batch.positions[row])
            replacement = self.plan.replacement()
            if replacement is not None:
                batch.positions[row] = replacement
                await self._submit(batch, [row])
                return
            batch.holes.add(row)
        self.rows_done(batch, 1)

    def rows_done(self, batch: Batch, count: int) -> None:
        """``count`` rows of ``batch`` are complete. Called on the loop or on a decode thread (once
        per job): the decrement takes a lock."""
        with self._rows_lock:
            batch.remaining -= count
            complete = batch.remaining == 0
        if complete:
            self._finish(batch)

    def _finish(self, batch: Batch) -> None:
        if self.board.finish(batch):
            call_in_loop(self.loop, self._all_complete.set)


def call_in_loop(loop: asyncio.AbstractEventLoop, callback: Callable[[], Any]) -> None:
    """Schedules ``callback`` on ``loop`` from any thread, unless the loop has already finished."""
    try:
        loop.call_soon_threadsafe(callback)
    except RuntimeError:
        pass  # closed: everything was produced, or the run was stopped

