"""One iteration over an epoch: the event loop thread that issues reads, the decode threads that
write samples into batch rows, and the user-side wait for complete batches.

Batches take the epoch's positions from a cursor, ``batch_size`` at a time. A sample that fails
either fails its batch (``on_error="raise"``: the user gets its ``SampleError`` at that batch) or
(``"skip"``) is recorded and its row is given the cursor's next position, so batches stay full.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ..autotune import AsyncGate, Gate
from ..batch.buffers import BatchBuffer, BufferRing, SampleLayout
from ..io.cache import ShardCache
from ..device import DeviceStage, PendingCopy, convert_batch
from ..errors import SampleError, TooManyFailures
from ..order.positions import Cursor, Positions
from ..io.reader import Reader
from .jobs import Batch, Row, RowFiller, chunk_rows, labelled, local_path
from ..sources.shards import ShardSource, ShardStream
from ..stats.figures import LoaderStats
from .workers import DecodeWorkers

STOP_TIMEOUT_S = 20.0  # how long stop() waits for the threads: a read's timeout is on its own threads


def is_labelled(item: Any) -> bool:
    """A ``(key, int label)`` pair."""
    return (
        isinstance(item, (tuple, list))
        and len(item) == 2
        and isinstance(item[1], (int, np.integer))
        and not isinstance(item[1], bool)
    )


@dataclass
class Settings:
    """What an epoch run needs from the loader (not the loader itself, so that dropping the
    loader is never delayed by a running thread holding it)."""

    source: Sequence[Any]
    read: Callable[[Any], Any] | bool | None
    decode: Callable[[Any], Any]
    labelled: bool
    batch_size: int
    drop_last: bool
    num_threads: int  # decode threads started (the most the tuner may use)
    io_concurrency: int  # reads in flight; the tuner may change it between and during epochs
    thread_gate: Gate | None  # with num_threads="auto": how many decode threads may work at once
    prefetch: int
    in_order: bool
    skip_errors: bool
    max_failures: int | float
    storage_options: dict[str, Any] | None
    read_timeout: float
    read_retries: int
    normalize: tuple[Sequence[float], Sequence[float]] | None
    ring: BufferRing
    device_stage: DeviceStage | None
    stats: LoaderStats


@dataclass(frozen=True)
class BatchQuota:
    """How many batches a run must deliver whatever fails (``count``), the last one with
    ``last_size`` rows: ranks of a DDP job must all deliver the same number of batches."""

    count: int
    last_size: int


class EpochRun:
    """Delivers the batches of one epoch's ``order`` (source indices), leaving out the positions
    in ``done``. Iterate it on the user's thread; ``stop()`` ends every thread it started.

    With a ``quota``, skipped samples that the epoch has no item left for are replaced by samples
    repeated from the start of the order (as ``DistributedSampler`` pads), so the run delivers
    exactly ``quota.count`` batches.

    ``skipped``: positions an earlier run of this epoch skipped (a resume): they are not read
    again, not used as padding, and count against the failure budget, which spans the epoch."""

    def __init__(self, settings: Settings, epoch: int, order: np.ndarray, done: Positions,
                 quota: BatchQuota | None = None, skipped: Positions | None = None) -> None:
        self.s = settings
        self.quota = quota
        self._next_padding = 0  # the next position to repeat, with a quota
        self._failed_positions: set[int] = set()
        self._earlier_failures = 0
        if skipped is not None and len(skipped):
            self._failed_positions = {p for start, stop in skipped.intervals() for p in range(start, stop)}
            self._earlier_failures = len(self._failed_positions)
            done = Positions([*done.intervals(), *skipped.intervals()])
        self.skipped_delivered: list[int] = []  # skipped positions of the batches handed out, for the state
        self._skipped_early: list[int] = []  # skipped while the layout was learnt: go with the first batch
        self.epoch = epoch
        self.order = order
        self.cursor = Cursor(len(order), done)
        # What a shard run reads: the rest of the epoch (taken here, with the cursor, on the user's thread).
        self._undelivered = _undelivered(order, done) if isinstance(settings.source, ShardSource) else None
        self.failure_limit = _failure_limit(settings.max_failures, len(order))
        self.failures: list[SampleError] = []
        self.loop = asyncio.new_event_loop()
        self.workers = DecodeWorkers(settings.num_threads, settings.thread_gate)
        self._chunk = chunk_rows(settings.batch_size, settings.num_threads)
        self._cond = threading.Condition()
        self._rows_lock = threading.Lock()
        self._finished: dict[int, Batch] = {}
        self._batch_count: int | None = None  # known once the cursor is exhausted
        self._loop_ended = False
        self._fatal: BaseException | None = None
        self._handed_out = 0
        self._in_pipeline: list[Batch] = []
        self._pending_copies: dict[int, PendingCopy] = {}
        self._handed: BatchBuffer | None = None  # the buffer of the batch the user holds
        self._stopped = False  # no batch is handed out any more
        self._stop_done = False  # every thread has ended and the run's state is released
        self._room = asyncio.Event()  # set by the consumer when a batch leaves the pipeline
        self._completed = 0  # batches complete (every row done or failed)
        self._all_complete = asyncio.Event()  # the loop stays up until then: failures need it
        self._read_slots = AsyncGate(self._sample_slots(settings))
        self._shards: ShardStream | None = None  # a shard source's reads, made on the loop
        self._reader: Reader | None = None
        self.filler = RowFiller(settings.decode, epoch, settings.stats, self._read_other, self._rows_done, self._job_failed)
        settings.stats.run_started()
        self._main = self.loop.create_task(self._produce_all())
        self.thread = threading.Thread(target=self._run_loop, name="asyncload-loop", daemon=True)
        self.thread.start()

    @staticmethod
    def _sample_slots(settings: Settings) -> int:
        """Samples whose read may be under way at once. With tar shards the reads are the shard
        stream's ranged chunk reads, which ``io_concurrency`` caps there; a sample only waits for
        its chunk, and the prefetch window bounds how many do."""
        if isinstance(settings.source, ShardSource):
            return settings.batch_size * settings.prefetch
        return settings.io_concurrency

    # ----- the event loop thread -----

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._main)
        except BaseException as error:  # cancelled by stop(), or a bug: the consumer must know
            if not isinstance(error, asyncio.CancelledError):
                self._fatal = error
        finally:
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()
            with self._cond:
                self._loop_ended = True
                self._cond.notify_all()

    async def _produce_all(self) -> None:
        reader = Reader(
            self.loop,
            storage_options=self.s.storage_options,
            timeout=self.s.read_timeout,
            retries=self.s.read_retries,
            io_concurrency=self.s.io_concurrency,
            stats=self.s.stats,
            user_read=self.s.read if callable(self.s.read) else None,
        )
        self._reader = reader
        self._shards = self._shard_stream(reader) if isinstance(self.s.source, ShardSource) else None
        self._tasks: set[asyncio.Task] = set()
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

    def _shard_stream(self, reader: Reader) -> ShardStream:
        """Ranged reads for the samples of this run's order not yet delivered, through the
        disk cache for remote shards when the source has one."""
        source = self.s.source
        assert isinstance(source, ShardSource) and self._undelivered is not None
        read_range = reader.read_range
        cache = None
        if source.cache_dir is not None:
            cache = ShardCache(source.cache_dir, source.cache_bytes, reader.read_range, source.chunk_bytes, reader.run_blocking,
                               version=reader.version)
            sizes = dict(zip(source.urls, source.shard_bytes.tolist()))

            async def read_range(url: str, start: int, end: int) -> bytes:
                if reader.is_local(url):
                    return await reader.read_range(url, start, end)
                return await cache.read_range(url, start, end, sizes[url])

        return ShardStream(source, self._undelivered, read_range, self.s.io_concurrency, cache=cache)

    async def _produce(self) -> None:
        """Issues every sample's load, batch by batch in order, at most ``io_concurrency`` reads
        in flight and at most ``prefetch`` batches ahead of the user."""
        number = 0
        first_sample = None
        while True:
            if number - self._handed_out >= self.s.prefetch:
                await self._wait_for_room(number)
            positions = self._take_batch(number)
            if not positions:
                break
            if self.s.ring.layout is None:
                first_sample = await self._learn_layout(number, positions)
                if first_sample is None:
                    break
            batch = Batch(number, positions, self.s.ring.take(), remaining=len(positions))
            self._in_pipeline.append(batch)
            number += 1
            rows = range(len(positions))
            if first_sample is not None:  # row 0 of the first batch: already decoded
                self.workers.submit(lambda b=batch, s=first_sample: self.filler.write_job(b, 0, s[1], s[0]))
                first_sample, rows = None, range(1, len(positions))
            await self._submit(batch, rows)
        with self._cond:
            self._batch_count = number
            every_batch_complete = self._completed >= number
            self._cond.notify_all()
        if every_batch_complete:
            self._all_complete.set()

    def _take_batch(self, number: int) -> list[int]:
        """The positions of batch ``number``: the cursor's next ones, padded to the quota's
        batch size once the cursor runs short; none when the epoch has no batch left."""
        size = self.s.batch_size
        if self.quota is not None:
            if number >= self.quota.count:
                return []
            size = self.quota.last_size if number == self.quota.count - 1 else size
        if self.s.drop_last and self.quota is None:  # the rest stays, to replace skipped samples
            return self.cursor.take(size, whole=True)
        positions = self.cursor.take(size)
        if self.quota is not None and len(positions) < size:
            positions += self._padding(size - len(positions))
        if self.s.drop_last and len(positions) < self.s.batch_size:
            return []
        return positions

    def _padding(self, count: int) -> list[int]:
        """Up to ``count`` positions to repeat: from the start of the order, passing over the
        ones that failed; one pass, so a run whose samples all fail still ends."""
        taken: list[int] = []
        while len(taken) < count and self._next_padding < len(self.order):
            if self._next_padding not in self._failed_positions:
                taken.append(self._next_padding)
            self._next_padding += 1
        return taken

    async def _wait_for_room(self, number: int) -> None:
        """Waits until fewer than ``prefetch`` batches are ahead of the user."""
        self.s.stats.level("producer_waiting", 1)
        try:
            while number - self._handed_out >= self.s.prefetch:
                self._room.clear()
                await self._room.wait()
        finally:
            self.s.stats.level("producer_waiting", -1)

    def _spawn(self, coroutine: Any) -> None:
        """Runs ``coroutine`` as a task of this run; once the run is stopped nothing starts (a
        late failure of a local read would otherwise leave a task the closing loop never runs)."""
        if self._stopped:
            coroutine.close()
            return
        task = self.loop.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

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
                failure = self._record(positions[0], error if isinstance(error, SampleError) else SampleError(key, "decode", error))
                if failure is not None:
                    self._finish(Batch(number, positions, None, 0, {0: failure}))
                    return None
                self._skipped_early.append(positions[0])
                replacement = self.cursor.take(1)
                if not replacement:
                    return None  # every remaining sample failed and was skipped
                positions[0] = replacement[0]
        sample = labelled(sample, label)
        self.s.ring.configure(SampleLayout.of(sample), self.s.batch_size)
        return key, sample

    def _split(self, index: int) -> tuple[Any, int | None]:
        """The source item at ``index`` -> (what to read, label or None)."""
        try:
            item = self.s.source[index]
        except Exception as error:
            raise SampleError(f"source[{index}]", "source", error) from error
        if not self.s.labelled:
            return item, None
        if not is_labelled(item):
            raise SampleError(item, "source", TypeError("expected a (url, label) pair like the first item"))
        return item[0], int(item[1])

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
        """Starts the loads of ``rows`` of ``batch``. Local files go to the decode threads by
        chunks (each job reads and decodes its rows, with no hand-off back to the loop); other
        items are read here, within ``io_concurrency``, then decoded one job each."""
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
                    self._submit_job(batch, local)
                    local = []
            else:
                await self._read_slots.acquire()
                self._spawn(self._load(batch, Row(row, key, label, index)))
        if local:
            self._submit_job(batch, local)

    def _submit_job(self, batch: Batch, rows: list[Row]) -> None:
        if not self._stopped:
            self.workers.submit(lambda: self.filler.fill(batch, rows))

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
            return
        except Exception as error:  # not the sample's fault, but it must not be lost either
            await self._failed(batch, row.row, SampleError(f"source[{row.index}]", "load", error))
            return
        self._submit_job(batch, [row])

    def _job_failed(self, batch: Batch, row: int, error: SampleError) -> None:
        """On a decode thread: a row failed. The failure policy may take the cursor's next
        position, which the loop owns: run it there."""
        self._call_in_loop(lambda: self._spawn(self._failed(batch, row, error)))

    def set_io_limit(self, limit: int) -> None:
        """Changes how many reads may be in flight, from any thread."""
        self._call_in_loop(lambda: (self._read_slots if self._shards is None else self._shards).set_limit(limit))

    async def _failed(self, batch: Batch, row: int, error: SampleError) -> None:
        """A sample failed. Raising: its batch carries the error. Skipping: the row gets the
        epoch's next position, or becomes a hole if the epoch has none left."""
        failure = self._record(batch.positions[row], error)
        if failure is not None:
            batch.errors[row] = failure
        else:
            batch.skipped.append(batch.positions[row])
            replacement = self.cursor.take(1)
            if not replacement and self.quota is not None:
                replacement = self._padding(1)
            if replacement:
                batch.positions[row] = replacement[0]
                await self._submit(batch, [row])
                return
            batch.holes.add(row)
        self._rows_done(batch, 1)

    def _record(self, position: int, error: SampleError) -> SampleError | None:
        """Counts the failure of the sample at ``position``; returns the error its batch must
        raise, or None to skip the sample. A sample that fails again (padding repeated it) is
        skipped without counting twice."""
        if position in self._failed_positions and self.s.skip_errors:
            return None
        self._failed_positions.add(position)
        self.s.stats.add_failure(error.item, error.stage, error.cause)
        self.failures.append(error)
        if not self.s.skip_errors:
            return error
        if self._earlier_failures + len(self.failures) > self.failure_limit:
            return TooManyFailures(self.failures, self.s.max_failures)
        return None

    def _rows_done(self, batch: Batch, count: int) -> None:
        """``count`` rows of ``batch`` are complete. Called on the loop or on a decode thread (once
        per job): the decrement takes a lock."""
        with self._rows_lock:
            batch.remaining -= count
            complete = batch.remaining == 0
        if complete:
            self._finish(batch)

    def _finish(self, batch: Batch) -> None:
        self.s.stats.level("batches_ready", 1)
        with self._cond:
            self._finished[batch.number] = batch
            self._completed += 1
            last = self._batch_count is not None and self._completed >= self._batch_count
            self._cond.notify_all()
        if last:
            self._call_in_loop(self._all_complete.set)

    # ----- the user's thread -----

    def __iter__(self) -> Iterator[tuple[list[int], Any]]:
        """Yields ``(epoch positions, batch)`` for each complete batch."""
        number = 0
        while True:
            if self._stopped:
                raise RuntimeError("this iteration has ended: the loader was closed or iterated anew")
            batch = self._wait_for(number if self.s.in_order else None)
            if batch is None:
                return
            error = batch.first_error()
            if error is not None:
                raise error
            if batch.holes and self.s.drop_last and self.quota is None:
                self._drop(batch)  # skips left it short and the epoch has no sample left for it
                number += 1
                continue
            out = self._hand_out(batch)
            self.skipped_delivered += batch.skipped + self._skipped_early
            self._skipped_early = []
            number += 1
            self._prefetch_copy(number)
            try:
                yield [p for row, p in enumerate(batch.positions) if row not in batch.holes], out
            finally:
                del out
                self._release_handed()  # the user asked for the next batch, or ended the loop

    def _wait_for(self, number: int | None) -> Batch | None:
        """Blocks until batch ``number`` (or, with None, any batch) is complete; None once the
        epoch has no more batches."""
        started = time.perf_counter()
        with self._cond:
            while True:
                ready = number if number is not None else next(iter(self._finished), None)
                if ready in self._finished:
                    batch = self._finished.pop(ready)
                    self.s.stats.level("batches_ready", -1)
                    break
                if self._batch_count is not None and self._handed_out >= self._batch_count:
                    return None
                if self._stopped:
                    raise RuntimeError("this iteration has ended: the loader was closed or iterated anew")
                if self._loop_ended:
                    raise RuntimeError("the loader's event loop stopped unexpectedly") from self._fatal
                self._cond.wait()
        self.s.stats.add_batch(len(batch.positions) - len(batch.holes), time.perf_counter() - started)
        return batch

    def _hand_out(self, batch: Batch) -> Any:
        """The user's view of a complete batch; frees its place in the prefetch window."""
        assert batch.buffer is not None
        size = batch.buffer.close_holes(len(batch.positions), batch.holes)
        stage = self.s.device_stage
        if stage is not None:
            pending = self._pending_copies.pop(batch.number, None) or self._start_copy(batch.buffer, size)
            out = batch.buffer.layout.unflatten(stage.hand_over(pending))
        elif self.s.normalize is not None:  # non-image fields go out as they are: tracked views
            out = batch.buffer.layout.unflatten(convert_batch(batch.buffer.views(size), self.s.normalize))
            self._handed = batch.buffer
        else:
            out = batch.buffer.batch(size)
            self._handed = batch.buffer
        self._in_pipeline.remove(batch)
        self._handed_out += 1
        self._call_in_loop(self._room.set)
        return out

    def _drop(self, batch: Batch) -> None:
        """With ``drop_last``: a batch that cannot be filled is not delivered (its good samples
        are the epoch's dropped rest, as ``drop_last`` drops a short last batch)."""
        assert batch.buffer is not None
        batch.buffer.give_back()
        self.skipped_delivered += batch.skipped
        self._in_pipeline.remove(batch)
        self._handed_out += 1
        self._call_in_loop(self._room.set)

    def _release_handed(self) -> None:
        """The user has moved past the batch last handed out (see ``BatchBuffer.released``)."""
        handed, self._handed = self._handed, None
        if handed is not None:
            handed.released()

    def _prefetch_copy(self, number: int) -> None:
        """With a device stage: if batch ``number`` is already complete, start its copy now, so
        it runs on the side stream while the user works on the batch just handed out."""
        stage = self.s.device_stage
        if stage is None or not self.s.in_order:
            return
        with self._cond:
            batch = self._finished.get(number)
        if batch is not None and not batch.errors and not batch.holes and number not in self._pending_copies:
            assert batch.buffer is not None
            self._pending_copies[number] = self._start_copy(batch.buffer, len(batch.positions))

    def _start_copy(self, buffer: BatchBuffer, size: int) -> PendingCopy:
        """Issues a batch's host-to-device copy. The stats count batches and bytes and the host
        time to issue it; the copy itself runs on the GPU, overlapped, unmeasured by design."""
        assert self.s.device_stage is not None
        started = time.perf_counter()
        pending = self.s.device_stage.start_copy(buffer, size)
        nbytes = sum(t[:size].nbytes for t in buffer.tensors)
        self.s.stats.add("copy", time.perf_counter() - started, nbytes)
        return pending

    def _call_in_loop(self, callback: Callable[[], Any]) -> None:
        """Schedules ``callback`` on the event loop, unless the loop has already finished."""
        try:
            self.loop.call_soon_threadsafe(callback)
        except RuntimeError:
            pass  # closed: everything was produced, or the run was stopped

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Ends the event loop and the decode threads, and returns unused buffers to the ring.
        Safe to call more than once and from ``__del__``; waits at most about ``timeout`` s.
        A stop cut short (Ctrl-C while it waits, or a thread stuck in a read or a user's
        decode past the timeout: then a ``RuntimeWarning``) is finished by the next call.
        Buffers go back to the ring only once no decode thread can write into them."""
        if self._stop_done:
            return
        self._stopped = True
        self._release_handed()
        self._call_in_loop(self._main.cancel)
        deadline = time.monotonic() + timeout
        _wait_ended([self.thread], deadline)
        self.workers.stop(timeout=0)  # no queued job starts; the threads end after the one they run
        _wait_ended(self.workers.all_threads()[:1], deadline)  # the starter: then the list is whole
        threads = [self.thread, *self.workers.all_threads()]
        alive = [thread.name for thread in _wait_ended(threads, deadline)]
        if alive:
            warnings.warn(f"asyncload: {len(alive)} threads still running {timeout:g} s after stop() "
                          f"({', '.join(alive)}); a later stop() or close() finishes the job", RuntimeWarning)
            return
        self._stop_done = True
        for batch in self._in_pipeline:
            if batch.buffer is not None and batch.number not in self._pending_copies:
                batch.buffer.give_back()
        self._in_pipeline.clear()
        self._pending_copies.clear()
        self.s.stats.level("batches_ready", -len(self._finished))
        self._finished.clear()
        self.s.stats.run_stopped()


def _wait_ended(threads: list[threading.Thread], deadline: float) -> list[threading.Thread]:
    """Waits until ``threads`` have ended or ``deadline`` (``time.monotonic()``) has passed;
    returns those still running. Ended means gone from ``threading.enumerate()``: after a join
    cut short by Ctrl-C, CPython 3.11 marks a thread that is still running as stopped, and its
    ``is_alive()`` and ``join()`` no longer wait for it."""
    while True:
        running = set(threading.enumerate())
        pending = [thread for thread in threads if thread in running]
        left = deadline - time.monotonic()
        if not pending or left <= 0:
            return pending
        started = time.monotonic()
        pending[0].join(min(left, 0.05))
        if time.monotonic() - started < 0.005:  # a join that no longer waits: poll instead
            time.sleep(min(left, 0.01))


def _undelivered(order: np.ndarray, done: Positions) -> np.ndarray:
    """The source indices of ``order`` at positions not in ``done``, in order."""
    wanted = np.ones(len(order), dtype=bool)
    for start, stop in done.intervals():
        wanted[start:stop] = False
    return order[wanted]


def _failure_limit(max_failures: int | float, epoch_size: int) -> int:
    """How many failures an epoch may have: a count, or a fraction of the epoch's samples."""
    if isinstance(max_failures, float):
        return math.floor(max_failures * epoch_size)
    return max_failures
