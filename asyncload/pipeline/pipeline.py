"""The pipeline: moves samples and decides nothing, the same code in this process and in each
child of ``processes=N``. It takes the driver's messages (``messages.py``: ``Start`` and ``Stop``
a run, ``Fill`` rows of a batch buffer with given source indices, ``Probe`` the first sample's
layout). A fill reads (local files on the decode threads, by chunks of rows; other items on the
event loop, at most ``io_concurrency`` in flight; tar shards through the run's ``ShardStream``),
decodes straight into the rows (``jobs.py``, ``batched.py``, on ``workers.py``'s threads) and
answers one ``Done`` naming the rows that failed: what a failure means is the driver's.

A row ends exactly once: the loop task that reads it (failed, or cancelled before its decode was
queued) or the decode job (which, for a stopped run, ends its rows undecoded). So ``Stopped``
goes out only once no thread can still write into the run's buffers.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable

from ..batch.buffers import BatchBuffer
from ..batch.layout import SampleLayout
from ..batch.ragged import take_aside
from ..cache.items import KeptCaches, KeptRead, item_cache
from ..errors import SampleError
from ..gates import AsyncGate, Gate
from ..io.reader import Reader
from ..settings import LoaderSettings, share
from ..sources.shard_stream import reader_shard_stream
from .batched import BatchJobs, is_batched
from .jobs import Row, RowFiller, RowJobs, Work, chunk_rows, labelled, local_path, split
from .messages import Done, Failed, Fill, Poisoned, Probe, Probed, Start, Stop, Stopped
from .refetch import Refetch
from .run_state import RunState
from .watchdog import Watchdog
from .threads import LoopThread, wait_ended
from .workers import DecodeWorkers


class Pipeline:
    """Reads and decodes into batch buffers it is given by number (``buffers``); answers through
    ``send`` (thread-safe). ``handle`` takes messages from one thread; ``close`` ends its threads.
    ``processes``: in a child, how many there are, for its ``share`` of the threads and reads;
    in this process, the loader's ``gate`` and the tuner's ``io_concurrency`` come instead."""

    def __init__(self, settings: LoaderSettings, buffers: Callable[[int], BatchBuffer],
                 send: Callable[[Any], None], stats: Any, processes: int = 0, gate: Gate | None = None,
                 io_concurrency: int | None = None, kept: KeptCaches | None = None) -> None:
        self.s = settings
        self.buffers = buffers
        self.send = send
        self.stats = stats
        threads = share(settings.threads_started, processes)
        if gate is None and settings.auto_threads:
            gate = Gate(share(settings.num_threads, processes))
        self.gate = gate
        self.workers = DecodeWorkers(threads, self.gate)
        self.io_limit = io_concurrency if io_concurrency is not None else share(settings.io_concurrency, processes)
        self.read_slots = AsyncGate(self.io_limit)
        self.runs: dict[int, RunState] = {}
        self._chunk = chunk_rows(settings.batch_size, threads)
        self._lock = threading.Lock()  # row counts and run states, shared by the loop and decode threads
        self._closing = False  # close() has scheduled the loop's shutdown
        self.loop_thread = LoopThread()
        self.loop, self.thread = self.loop_thread.loop, self.loop_thread.thread
        self.reader: Reader = asyncio.run_coroutine_threadsafe(self._new_reader(), self.loop).result()
        # what the caches keep for the next pass: the caller's (one pipeline per pass), else this one's
        self.kept, self._owns_kept = (kept, False) if kept is not None else (KeptCaches(), True)
        self.cached_read = None if settings.read is not None else \
            item_cache(settings.source, self.reader, self.kept)
        Watchdog(self.loop, self.workers, settings.decode_timeout, self._stuck).start()

    async def _new_reader(self) -> Reader:
        """The pipeline's reader, made on its event loop."""
        s = self.s
        return Reader(self.loop, storage_options=s.storage_options, timeout=s.read_timeout, retries=s.read_retries,
                      io_concurrency=self.io_limit, stats=self.stats, user_read=s.read if callable(s.read) else None,
                      retry_seconds=s.read_retry_seconds, max_bytes=s.max_sample_bytes)

    # ----- the driver's thread (or a child's control thread) -----

    def handle(self, message: Any) -> None:
        """Takes one message of the driver; the work happens on the loop and decode threads."""
        if isinstance(message, Stop):
            self._mark_stopped(message.run)
        self.loop_thread.call_soon(self._on_loop, message)

    def set_limits(self, num_threads: int | None, io_concurrency: int | None) -> None:
        """The tuner's new settings for this pipeline (None: unchanged)."""
        if num_threads is not None and self.gate is not None:
            self.gate.set_limit(num_threads)
        if io_concurrency is not None:
            self.loop_thread.call_soon(self._set_io, io_concurrency)

    def close(self, deadline: float | None = None) -> list[threading.Thread]:
        """Stops every run, the loop and the decode threads; returns the threads still running
        at ``deadline`` (``time.monotonic()``; None: wait for them)."""
        for run in list(self.runs):
            self._mark_stopped(run)
        with self._lock:
            first, self._closing = not self._closing, True
        if first:  # a second close (another thread) only waits: its shutdown would never run
            self.loop_thread.submit(self._shut())
        self.workers.wind_down(deadline, self.s.decode_timeout)  # no job starts; those running end or are abandoned
        wait_ended([self.thread], deadline)
        wait_ended(self.workers.all_threads()[:1], deadline)  # the starter: then the list is whole
        return wait_ended([self.thread, *self.workers.all_threads()], deadline)

    def _mark_stopped(self, run: int) -> None:
        """No job of ``run`` starts any more (the decode threads look at this)."""
        with self._lock:
            state = self.runs.get(run)
            if state is not None:
                state.stop_jobs()

    # ----- the event loop -----

    def _on_loop(self, message: Any) -> None:
        if isinstance(message, Start):
            self._start(message)
        elif isinstance(message, Fill):
            self.spawn(self.runs[message.run], self._fill(message))
        elif isinstance(message, Probe):
            self.spawn(self.runs[message.run], self._probe(message))
        elif isinstance(message, Stop):
            self.loop.create_task(self._stop(message.run))

    def _start(self, message: Start) -> None:
        filler = RowFiller(self.s.decode, message.epoch, self.stats, self._read_other, self.rows_done,
                           Refetch(self).row_failed, max_bytes=self.s.max_sample_bytes,
                           poisoned=lambda work: self.send(Poisoned(work.run.run, work.buffer.slot)))  # a stuck decode_into
        jobs = (BatchJobs if is_batched(self.s.decode) else RowJobs)(filler, self.workers.submit)
        stream = None
        if message.chunks is not None:
            stream = reader_shard_stream(self.s.source, message.chunks, self.reader, self.io_limit,  # type: ignore[arg-type]
                                         self.kept.shard_copies(self.s.source))
        self.runs[message.run] = RunState(message.run, filler, jobs, stream)

    def spawn(self, state: RunState, coroutine: Any) -> asyncio.Task | None:
        if state.stopped:
            coroutine.close()
            return None
        task = self.loop.create_task(coroutine)
        state.track(task, self.send)
        return task

    async def _fill(self, message: Fill) -> None:
        """Starts the loads of a fill's rows: local files by chunks of rows, each a decode job that
        reads them itself; others read here, one decode job each. A batched decoder's rows are
        held until none of the fill is still being read, then make one job."""
        state = self.runs[message.run]
        work = Work(message.fill, self.buffers(message.segment), len(message.rows), state, rows=message.rows)
        if work.buffer.side:  # left by a fill of a stopped run (a child's buffers are never taken afresh)
            take_aside(work.buffer, work.rows)
        with self._lock:
            state.active += 1
            state.by_id[work.fill_id] = work
        jobs = state.jobs
        jobs.hold(work)
        handed = 0  # rows whose end is someone else's now (a job, a read task, a failure)
        try:
            local: list[Row] = []
            for row, index in zip(message.rows, message.indices.tolist()):
                try:
                    key, label = split(self.s.source, self.s.labelled, index)
                except SampleError as error:
                    handed += 1
                    self.row_failed(work, row, error)
                    continue
                kept = state.probed.pop(index, None)
                if kept is not None:  # the probe's sample: decoded already
                    handed += 1
                    self.workers.submit(lambda r=row, k=kept: state.filler.write_job(work, r, k[1], k[0]))
                elif self._is_local(state, key):
                    local.append(Row(row, key, label, index, key if self.s.read is False else None))
                    if len(local) == self._chunk:
                        handed += len(local)
                        jobs.add(work, local)
                        local = []
                elif (hit := self._cached_hit(state, key, index)) is not None:  # read by the decode thread
                    local.append(Row(row, key, label, index, hit))
                    if len(local) == self._chunk:
                        handed += len(local)
                        jobs.add(work, local)
                        local = []
                else:
                    await self.read_slots.acquire()
                    handed += 1
                    jobs.hold(work)  # released by _load
                    if self.spawn(state, self._load(state, work, Row(row, key, label, index))) is None:
                        self.read_slots.release()
                        jobs.release(work)
                        self.rows_done(work, 1)
            if local:
                handed += len(local)
                jobs.add(work, local)
        except asyncio.CancelledError:  # stopped: the rows not handed on end here
            self.rows_done(work, len(message.rows) - handed)
            raise
        finally:
            jobs.release(work)

    def _cached_hit(self, state: RunState, key: Any, index: int) -> KeptRead | None:
        """A kept copy of ``key`` in the item cache, or of its shard in the shard cache, that a
        decode thread reads itself: no read task, no trip through the loop (the warm epoch's
        reads cost less than a GET's)."""
        if state.stream is not None:
            return state.stream.hit(key) if self.s.read is None else None
        if self.cached_read is None:
            return None
        return self.cached_read.hit(key, index)

    def _is_local(self, state: RunState, key: Any) -> bool:
        """Whether a decode thread takes ``key`` itself: local files with the loader's own read,
        or the item itself with ``read=False``."""
        if self.s.read is False:
            return True
        if self.s.read is not None or state.stream is not None:
            return False
        return local_path(key) is not None or self.reader.is_local(key)

    async def _fetch(self, state: RunState, key: Any, index: int, copy: bool = True) -> Any:
        """The item's bytes (or, with ``copy``, possibly a ``CopyRead`` of its cached copy, which
        the decode job reads)."""
        if self.s.read is False:
            return key
        try:
            if state.stream is not None:
                return await state.stream.get(key)
            cached = None if self.cached_read is None else self.cached_read.read(key, index, copy)
            return await (cached if cached is not None else self.reader.read(key))
        except Exception as error:
            raise SampleError(key, "read", error) from error

    async def _load(self, state: RunState, work: Work, row: Row) -> None:
        """Reads a sample on the loop, then hands it to a decode job; a failed read is reported,
        a cancelled one ends its row, so the row always ends once."""
        try:
            try:
                row.data = await self._fetch(state, row.key, row.index)
            finally:
                self.read_slots.release()
        except asyncio.CancelledError as error:
            if state.stopped or state.closed:  # the run's stop: the row ends unfilled, unseen
                self.rows_done(work, 1)
                raise
            # Raised inside the read (a client's own cancellation): the row failed, or it would
            # be handed out unwritten.
            self.row_failed(work, row.row, SampleError(row.key, "read", error))
        except SampleError as error:
            self.row_failed(work, row.row, error)
        except Exception as error:  # not the sample's fault, but it must not be lost either
            self.row_failed(work, row.row, SampleError(f"source[{row.index}]", "load", error))
        else:
            state.jobs.add(work, [row])
        finally:
            state.jobs.release(work)

    async def _probe(self, message: Probe) -> None:
        """Loads and decodes one sample for its layout; keeps it for the fill that names it."""
        state = self.runs[message.run]
        key: Any = f"source[{message.index}]"
        try:
            key, label = split(self.s.source, self.s.labelled, message.index)
            data = await self._fetch(state, key, message.index, copy=False)  # decoded as is
            try:
                sample = await self.workers.run_async(self.loop, state.filler.timed_decode, data)
                sample = labelled(sample, label)
                layout = SampleLayout.of(sample)
            except Exception as error:
                raise SampleError(key, "decode", error) from error
        except SampleError as error:
            self.send(Probed(message.run, None, error))
            return
        state.probed[message.index] = (key, sample)
        self.send(Probed(message.run, layout, None))

    async def _stop(self, run: int) -> None:
        """Cancels the run's reads and closes its shard stream; ``Stopped`` once no row is under way."""
        state = self.runs.get(run)
        if state is None or await state.close(self._lock):
            self.runs.pop(run, None)
            self.send(Stopped(run))

    async def _shut(self) -> None:
        try:
            for run in list(self.runs):
                if run in self.runs:  # not stopped meanwhile by its own Stop (each _stop yields a turn)
                    await self._stop(run)
            if self.cached_read is not None:
                await self.cached_read.aclose()
            if self._owns_kept:
                self.kept.close()
            await self.reader.aclose()
        finally:  # whatever closing raised, the loop ends: close() waits for its thread
            self.loop.stop()

    def _set_io(self, limit: int) -> None:
        self.io_limit = limit
        self.read_slots.set_limit(limit)
        for state in self.runs.values():
            if state.stream is not None:
                state.stream.set_limit(limit)

    def _stuck(self, message: str) -> None:
        """Too many decode threads are stuck to go on: every run fails (``Failed``)."""
        for run in [run for run, state in self.runs.items() if not state.stopped]:
            self.send(Failed(run, RuntimeError(message)))

    # ----- any thread -----

    def _read_other(self, key: str) -> bytes:
        """On a decode thread: a local URL that is not a plain path to a regular file (e.g.
        ``memory://``, a FIFO), read with the reader's timeout."""
        self.reader.is_local(key)  # finds (and caches) the URL's filesystem, which read_local uses
        return self.reader.read_local(key)

    def row_failed(self, work: Work, row: int, error: SampleError) -> None:
        with self._lock:
            work.failures.append((row, error))
        self.rows_done(work, 1)

    def rows_done(self, work: Work, count: int) -> None:
        """``count`` rows of ``work`` ended; the last one answers (or, once the run is stopped,
        lets the stop be confirmed)."""
        state: RunState = work.run
        with self._lock:
            work.remaining -= count
            if work.remaining:
                return
            state.active -= 1
            del state.by_id[work.fill_id]
            confirm = state.stopped and state.confirms()
        if not state.stopped:
            side = take_aside(work.buffer, work.rows) if work.buffer.side else None
            self.send(Done(state.run, work.fill_id, work.failures, side=side))
        elif confirm:
            self.loop_thread.call_soon(self.runs.pop, state.run, None)
            self.send(Stopped(state.run))
