"""AsyncLoader: the wiring of sampler, reads, decode threads, batch buffers and device stage, and
the iteration the user sees.

Each iteration (one epoch, or what is left of it) runs an ``_EpochRun``: an event loop on its
own thread issues reads and hands each sample to a decode thread, which writes it into its row
of a batch buffer. The user's thread waits for batches in order and raises a sample's error at
the batch it belongs to. Ending the iteration in any way stops the run's threads.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from .buffers import BatchBuffer, BufferRing, Field, SampleLayout
from .decode import ImageDecoder
from .device import DeviceStage, PendingCopy, convert_batch, resolve_device
from .errors import SampleError
from .read import Reader
from .sampler import EpochSampler, distributed_defaults
from .stats import LoaderStats

LABEL_FIELD = Field((), np.dtype(np.int64))


def _default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _is_labelled(item: Any) -> bool:
    return (
        isinstance(item, (tuple, list))
        and len(item) == 2
        and isinstance(item[1], (int, np.integer))
        and not isinstance(item[1], bool)
    )


@dataclass
class _Settings:
    """What an epoch run needs from the loader (not the loader itself, so that dropping the
    loader is never delayed by a running thread holding it)."""

    source: Sequence[Any]
    read: Callable[[Any], Any] | bool | None
    decode: Callable[[Any], Any]
    labelled: bool
    num_threads: int
    io_concurrency: int
    prefetch: int
    in_order: bool
    storage_options: dict[str, Any] | None
    read_timeout: float
    read_retries: int
    normalize: tuple[Sequence[float], Sequence[float]] | None
    ring: BufferRing
    device_stage: DeviceStage | None
    stats: LoaderStats


@dataclass
class _Batch:
    """One batch being filled: its number in the epoch, its source indices, and its buffer."""

    number: int
    indices: np.ndarray
    buffer: BatchBuffer | None
    remaining: int
    errors: dict[int, SampleError] = field(default_factory=dict)

    def first_error(self) -> SampleError | None:
        return self.errors[min(self.errors)] if self.errors else None


class AsyncLoader:
    """Batches from a source of URLs, ``(url, label)`` pairs, or keys, without worker processes.

    See ``DESIGN.md`` for the flow. Arguments beyond the design's contract:
    ``normalize=(mean, std)`` turns uint8 NHWC image fields into normalised float32 NCHW (on the
    GPU with a CUDA ``device``); ``read_timeout`` and ``read_retries`` bound each read.
    """

    def __init__(
        self,
        source: Sequence[Any],
        batch_size: int = 256,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        read: Callable[[Any], Any] | bool | None = None,
        decode: Callable[[Any], Any] | None = None,
        num_threads: int | None = None,
        io_concurrency: int = 64,
        prefetch: int = 2,
        in_order: bool = True,
        device: str | torch.device | None = None,
        on_error: str = "raise",
        storage_options: dict[str, Any] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        *,
        normalize: tuple[Sequence[float], Sequence[float]] | None = None,
        read_timeout: float = 60.0,
        read_retries: int = 3,
    ) -> None:
        if on_error != "raise":
            raise ValueError(f"on_error must be 'raise', got {on_error!r}")
        for name, value in (("io_concurrency", io_concurrency), ("prefetch", prefetch)):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if read is True or (read not in (None, False) and not callable(read)):
            raise TypeError(f"read must be None, False or a callable, got {read!r}")
        self.device = resolve_device(device)
        rank, world_size = distributed_defaults(rank, world_size)
        self.sampler = EpochSampler(
            len(source), batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last, rank=rank, world_size=world_size
        )
        self.epoch = 0
        self.stats = LoaderStats()
        self._delivered = _Delivered()  # batches of this epoch handed to the user, for state_dict()
        self._resume_from: _Delivered | None = None  # set by load_state_dict()
        self._run: _EpochRun | None = None
        self._closed = False
        self._settings = _Settings(
            source=source,
            read=read,
            decode=decode if decode is not None else ImageDecoder(),
            labelled=read is not False and len(source) > 0 and _is_labelled(source[0]),
            num_threads=num_threads or _default_threads(),
            io_concurrency=io_concurrency,
            prefetch=prefetch,
            in_order=in_order,
            storage_options=storage_options,
            read_timeout=read_timeout,
            read_retries=read_retries,
            normalize=normalize,
            ring=BufferRing(keep=prefetch + 2, pin_memory=torch.cuda.is_available()),
            device_stage=DeviceStage(self.device, normalize) if self.device is not None else None,
            stats=self.stats,
        )
        self._configure_known_layout()

    def _configure_known_layout(self) -> None:
        """With a decoder that declares its output (the default), buffers need no first sample."""
        output = getattr(self._settings.decode, "field", None)
        if isinstance(output, Field):
            tree, fields = (None, [output]) if not self._settings.labelled else ((None, None), [output, LABEL_FIELD])
            self._settings.ring.configure(SampleLayout(tree, fields), self.sampler.batch_size)

    def __len__(self) -> int:
        """Batches in one epoch for this rank."""
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        """Selects the shuffle of ``epoch`` (as ``DistributedSampler.set_epoch``)."""
        if epoch != self.epoch:
            self.epoch = epoch
            self._delivered = _Delivered()
            self._resume_from = None

    def __iter__(self) -> Iterator[Any]:
        if self._closed:
            raise RuntimeError("this AsyncLoader is closed")
        self._stop_run()  # a new iteration replaces an unfinished one
        # As with DataLoader, a new iteration starts the epoch afresh, unless load_state_dict()
        # asked to resume it.
        self._delivered, self._resume_from = self._resume_from or _Delivered(), None
        batches = self.sampler.batches(self.epoch)
        todo = [k for k in range(len(batches)) if not self._delivered.contains(k)]
        run = _EpochRun(self._settings, self.epoch, batches, todo)
        self._run = run
        return self._iterate(run)

    def _iterate(self, run: "_EpochRun") -> Iterator[Any]:
        try:
            for number, batch in run:
                self._delivered.add(number)
                yield batch
            self._delivered = _Delivered()  # the epoch is complete
        finally:
            run.stop()
            if self._run is run:
                self._run = None

    def state_dict(self) -> dict[str, Any]:
        """Where this epoch stands: enough to resume after the last delivered batch."""
        return {
            "epoch": self.epoch,
            "seed": self.sampler.seed,
            "num_batches": len(self),
            "rank": self.sampler.rank,
            "world_size": self.sampler.world_size,
            "delivered_prefix": self._delivered.prefix,
            "delivered_after_prefix": sorted(self._delivered.extra),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resumes from ``state_dict()``: the next iteration delivers the batches not yet delivered,
        in the same order as the uninterrupted run."""
        mine = self.state_dict()
        for key in ("seed", "num_batches", "rank", "world_size"):
            if state[key] != mine[key]:
                raise ValueError(f"state_dict was saved with {key}={state[key]}, this loader has {mine[key]}")
        self.epoch = state["epoch"]
        self._resume_from = _Delivered(state["delivered_prefix"], set(state["delivered_after_prefix"]))
        self._delivered = self._resume_from

    def _stop_run(self) -> None:
        if self._run is not None:
            self._run.stop()
            self._run = None

    def close(self) -> None:
        """Stops every thread and frees the batch buffers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop_run()
        self._settings.ring.clear()

    def __enter__(self) -> "AsyncLoader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class _Delivered:
    """Which batches of the epoch the user has received: a prefix and the few beyond it (only
    ``in_order=False`` delivers past a gap, and at most the prefetch window)."""

    def __init__(self, prefix: int = 0, extra: set[int] | None = None) -> None:
        self.prefix = prefix
        self.extra = extra or set()

    def contains(self, number: int) -> bool:
        return number < self.prefix or number in self.extra

    def add(self, number: int) -> None:
        self.extra.add(number)
        while self.prefix in self.extra:
            self.extra.remove(self.prefix)
            self.prefix += 1


class _EpochRun:
    """One iteration over ``todo`` (batch numbers of the epoch's ``batches``): the event loop
    thread, the decode pool, and the user-side iteration. ``stop()`` ends them all."""

    def __init__(self, settings: _Settings, epoch: int, batches: list[np.ndarray], todo: list[int]) -> None:
        self.s = settings
        self.epoch = epoch
        self.batches = batches
        self.todo = todo
        self.loop = asyncio.new_event_loop()
        self.decode_pool = ThreadPoolExecutor(settings.num_threads, thread_name_prefix="asyncload-decode")
        self._cond = threading.Condition()
        self._finished: dict[int, _Batch] = {}
        self._loop_ended = False
        self._fatal: BaseException | None = None
        self._handed_out = 0
        self._in_pipeline: list[_Batch] = []
        self._pending_copies: dict[int, PendingCopy] = {}
        self._stopped = False
        self._room = asyncio.Event()  # set by the consumer when a batch leaves the pipeline
        decode = settings.decode
        self._decode_in_place = isinstance(getattr(decode, "field", None), Field) and hasattr(decode, "decode_into")
        self._main = self.loop.create_task(self._produce_all())
        self.thread = threading.Thread(target=self._run_loop, name="asyncload-loop", daemon=True)
        self.thread.start()

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
        tasks: set[asyncio.Task] = set()
        try:
            await self._produce(reader, tasks)
            if tasks:
                await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await reader.aclose()

    async def _produce(self, reader: Reader, tasks: set[asyncio.Task]) -> None:
        """Issues every sample's load, batch by batch in order, at most ``io_concurrency`` reads
        in flight and at most ``prefetch`` batches ahead of the user."""
        if not self.todo:
            return
        first_sample = None
        if self.s.ring.layout is None:
            first_sample = await self._learn_layout(reader)
            if first_sample is None:
                return
        read_slots = asyncio.Semaphore(self.s.io_concurrency)
        for produced, number in enumerate(self.todo):
            while produced - self._handed_out >= self.s.prefetch:
                self._room.clear()
                await self._room.wait()
            indices = self.batches[number]
            batch = _Batch(number, indices, self.s.ring.take(), remaining=len(indices))
            self._in_pipeline.append(batch)
            for row, index in enumerate(indices):
                await read_slots.acquire()
                if first_sample is not None:  # row 0 of the first batch: already decoded
                    read_slots.release()
                    load = self._write_decoded(batch, row, *first_sample)
                    first_sample = None
                else:
                    load = self._load(batch, row, int(index), reader, read_slots)
                task = self.loop.create_task(load)
                tasks.add(task)
                task.add_done_callback(tasks.discard)

    async def _learn_layout(self, reader: Reader) -> tuple[Any, Any] | None:
        """Loads the epoch's first sample to learn the batch layout from it; returns its key and
        labelled sample, to be written into its row without a second read. On failure, its
        batch carries the error, nothing more is produced, and None is returned."""
        first = self.batches[self.todo[0]]
        key: Any = f"source[{int(first[0])}]"
        try:
            key, label = self._split(int(first[0]))
            data = await self._fetch(reader, key)
            started = time.perf_counter()
            sample = await self.loop.run_in_executor(self.decode_pool, self.s.decode, data)
            self.s.stats.add("decode", time.perf_counter() - started)
        except SampleError as error:
            self._finish(_Batch(self.todo[0], first, None, 0, {0: error}))
            return None
        except Exception as error:
            self._finish(_Batch(self.todo[0], first, None, 0, {0: SampleError(key, "decode", error)}))
            return None
        sample = self._labelled(sample, label)
        capacity = len(self.batches[0])  # the epoch's first batch is never a short one
        self.s.ring.configure(SampleLayout.of(sample), capacity)
        return key, sample

    def _split(self, index: int) -> tuple[Any, int | None]:
        """The source item at ``index`` -> (what to read, label or None)."""
        try:
            item = self.s.source[index]
        except Exception as error:
            raise SampleError(f"source[{index}]", "source", error) from error
        if not self.s.labelled:
            return item, None
        if not _is_labelled(item):
            raise SampleError(item, "source", TypeError("expected a (url, label) pair like the first item"))
        return item[0], int(item[1])

    async def _fetch(self, reader: Reader, key: Any) -> Any:
        if self.s.read is False:
            return key
        try:
            return await reader.read(key)
        except Exception as error:
            raise SampleError(key, "read", error) from error

    async def _load(self, batch: _Batch, row: int, index: int, reader: Reader, read_slots: asyncio.Semaphore) -> None:
        """Reads and decodes source item ``index`` into ``row`` of ``batch``. Every outcome ends
        in ``_row_done``, so a batch always completes and the user never waits forever."""
        try:
            try:
                key, label = self._split(index)
                local = self.s.read is None and reader.is_local(key)
                data = None if local else await self._fetch(reader, key)
            finally:
                read_slots.release()
            if local:
                await self.loop.run_in_executor(
                    self.decode_pool, self._read_and_decode_into, reader, batch.buffer, row, key, label, index
                )
            else:
                await self.loop.run_in_executor(self.decode_pool, self._decode_into, batch.buffer, row, key, data, label, index)
        except SampleError as error:
            self._record_error(batch, row, error)
        except Exception as error:  # not the sample's fault, but it must not be lost either
            self._record_error(batch, row, SampleError(f"source[{index}]", "load", error))
        self._row_done(batch)

    async def _write_decoded(self, batch: _Batch, row: int, key: Any, sample: Any) -> None:
        """Copies an already decoded sample into ``row`` of ``batch``."""
        assert batch.buffer is not None
        try:
            await self.loop.run_in_executor(self.decode_pool, batch.buffer.write, row, sample)
        except Exception as error:
            self._record_error(batch, row, SampleError(key, "decode", error))
        self._row_done(batch)

    def _record_error(self, batch: _Batch, row: int, error: SampleError) -> None:
        batch.errors[row] = error
        self.s.stats.add_failure(error.item, error.stage, error.cause)

    def _row_done(self, batch: _Batch) -> None:
        batch.remaining -= 1
        if batch.remaining == 0:
            self._finish(batch)

    def _read_and_decode_into(self, reader: Reader, buffer: BatchBuffer, row: int, key: str, label: int | None, index: int) -> None:
        """On a decode thread: reads a local URL, then decodes it into its row (one hand-off)."""
        try:
            data = reader.read_local(key)
        except Exception as error:
            raise SampleError(key, "read", error) from error
        self._decode_into(buffer, row, key, data, label, index)

    def _decode_into(self, buffer: BatchBuffer, row: int, key: Any, data: Any, label: int | None, index: int) -> None:
        """On a decode thread: decode ``data`` and write it into row ``row`` of ``buffer``."""
        started = time.perf_counter()
        decode = self.s.decode
        try:
            if self._decode_in_place:
                rows = buffer.rows(row)
                decode.decode_into(data, rows[0], (self.epoch, index))
                if label is not None:
                    rows[1][...] = label
            else:
                buffer.write(row, self._labelled(decode(data), label))
        except Exception as error:
            raise SampleError(key, "decode", error) from error
        self.s.stats.add("decode", time.perf_counter() - started)

    @staticmethod
    def _labelled(sample: Any, label: int | None) -> Any:
        return sample if label is None else (sample, np.int64(label))

    def _finish(self, batch: _Batch) -> None:
        with self._cond:
            self._finished[batch.number] = batch
            self._cond.notify_all()

    # ----- the user's thread -----

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        for position in range(len(self.todo)):
            if self._stopped:
                raise RuntimeError("this iteration has ended: the loader was closed or iterated anew")
            batch = self._wait_for(self.todo[position] if self.s.in_order else None)
            error = batch.first_error()
            if error is not None:
                raise error
            out = self._hand_out(batch)
            self._prefetch_copy(position + 1)
            yield batch.number, out

    def _wait_for(self, number: int | None) -> _Batch:
        """Blocks until batch ``number`` (or, with None, any batch) is complete."""
        started = time.perf_counter()
        with self._cond:
            while True:
                ready = number if number is not None else next(iter(self._finished), None)
                if ready in self._finished:
                    batch = self._finished.pop(ready)
                    break
                if self._loop_ended:
                    raise RuntimeError("the loader's event loop stopped unexpectedly") from self._fatal
                self._cond.wait()
        self.s.stats.add_batch(len(batch.indices), time.perf_counter() - started)
        return batch

    def _hand_out(self, batch: _Batch) -> Any:
        """The user's view of a complete batch; frees its place in the prefetch window."""
        assert batch.buffer is not None
        size = len(batch.indices)
        stage = self.s.device_stage
        if stage is not None:
            pending = self._pending_copies.pop(batch.number, None) or stage.start_copy(batch.buffer, size)
            out = batch.buffer.layout.unflatten(stage.hand_over(pending))
        elif self.s.normalize is not None:
            leaves = [t[:size] for t in batch.buffer.tensors]
            out = batch.buffer.layout.unflatten(convert_batch(leaves, self.s.normalize))
            batch.buffer.in_pipeline = False
        else:
            out = batch.buffer.batch(size)
        self._in_pipeline.remove(batch)
        self._handed_out += 1
        self._call_in_loop(self._room.set)
        return out

    def _call_in_loop(self, callback: Callable[[], Any]) -> None:
        """Schedules ``callback`` on the event loop, unless the loop has already finished."""
        try:
            self.loop.call_soon_threadsafe(callback)
        except RuntimeError:
            pass  # closed: everything was produced, or the run was stopped

    def _prefetch_copy(self, position: int) -> None:
        """With a device stage: if the next batch is already complete, start its copy now, so
        it runs on the side stream while the user works on the batch just handed out."""
        stage = self.s.device_stage
        if stage is None or position >= len(self.todo) or not self.s.in_order:
            return
        number = self.todo[position]
        with self._cond:
            batch = self._finished.get(number)
        if batch is not None and not batch.errors and number not in self._pending_copies:
            assert batch.buffer is not None
            self._pending_copies[number] = stage.start_copy(batch.buffer, len(batch.indices))

    def stop(self) -> None:
        """Ends the event loop and the decode threads, and returns unused buffers to the ring.
        Safe to call more than once and from ``__del__``."""
        if self._stopped:
            return
        self._stopped = True
        self._call_in_loop(self._main.cancel)
        self.thread.join()
        self.decode_pool.shutdown(wait=True, cancel_futures=True)
        for batch in self._in_pipeline:
            if batch.buffer is not None and batch.number not in self._pending_copies:
                batch.buffer.give_back()
        self._in_pipeline.clear()
        self._pending_copies.clear()
