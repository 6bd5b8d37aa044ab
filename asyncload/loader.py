"""AsyncLoader: the public object. It holds the settings, the sampler, the ring of batch
buffers and the epoch's progress; each iteration runs an ``EpochDriver`` (``run/driver.py``)
over its pipelines: one in this process (``run/pipes.py``), or N child processes (``procs/``).
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from .arguments import check_arguments, check_shard_arguments, initial_reads
from .autotune import MAX_IO, AutoTuner, Gate, Knob
from .batch.buffers import BufferRing, OnDevice
from .batch.layout import Field, SampleLayout
from .decode.image import ImageDecoder
from .device import DeviceStage, resolve_device
from .order.sampler import EpochSampler, distributed_defaults, source_digest
from .order.shard_order import ShardSampler
from .procs.processes import process_count, start_processes, window
from .run.batched import image_placement
from .run.driver import EpochDriver
from .run.pipes import LocalPipes, Pipes
from .run.settings import BatchQuota, Settings, is_labelled
from .run.state import Progress
from .sources.shards import ShardSource
from .stats.bar import ProgressBar
from .stats.figures import LoaderStats
from .stats.trace import DEFAULT_EVENTS, Tracer
from .stats.machine import usable_cores

LABEL_FIELD = Field((), np.dtype(np.int64))


class AsyncLoader:
    """Batches from a source of URLs, ``(url, label)`` pairs, or keys, without worker processes.

    Beyond the design's contract: ``num_threads`` and ``io_concurrency`` also take ``"auto"``
    (see ``autotune.py``); ``max_failures`` (with ``on_error="skip"``: a count, or a fraction of
    the epoch, of samples that may fail before ``TooManyFailures`` is raised); ``progress``
    shows a tqdm bar; ``normalize=(mean, std)`` turns uint8 NHWC image fields into normalised
    float32 NCHW (on the GPU with a CUDA ``device``); ``read_timeout`` and ``read_retries``
    bound each read; ``processes=N`` runs the pipeline in N child processes (``procs/``), and
    ``isolate=True`` is ``processes=1``. A batched ``decode`` (``GpuImageDecoder``) decodes each
    batch with one call, in this process (``run/batched.py``).
    ``io_concurrency`` counts requests in flight: for tar shards each is a ranged read of up to
    ``chunk_bytes`` (16 MiB), so its default there is 4 rather than 64.
    ``trace="run.json"`` writes a timeline of each run (every sample's read and decode on the
    thread and process that ran it, hand-outs, your waits, reads in flight, failures) as Chrome
    trace-event JSON, for Perfetto or chrome://tracing, when the loader is closed (``close()``,
    the end of a ``with`` block, or the program's exit); it keeps the last ``trace_events``
    events (default 200,000), so a long run's file and memory stay bounded.
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
        num_threads: int | str | None = None,
        io_concurrency: int | str | None = None,
        prefetch: int = 2,
        in_order: bool = True,
        device: str | torch.device | None = None,
        on_error: str = "raise",
        storage_options: dict[str, Any] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        *,
        max_failures: int | float = 0.01,
        progress: bool = False,
        normalize: tuple[Sequence[float], Sequence[float]] | None = None,
        read_timeout: float = 60.0,
        read_retries: int = 6,
        isolate: bool = False,
        processes: int | str | None = None,
        trace: str | os.PathLike | None = None,
        trace_events: int = DEFAULT_EVENTS,
    ) -> None:
        check_arguments(on_error, io_concurrency, prefetch, read, max_failures)
        cores = usable_cores()
        auto_threads, auto_io = num_threads == "auto", io_concurrency == "auto"
        threads = cores if auto_threads or num_threads is None else int(num_threads)
        io = initial_reads(io_concurrency, isinstance(source, ShardSource))
        self.device = resolve_device(device)
        rank, world_size = distributed_defaults(rank, world_size)
        order = dict(shuffle=shuffle, seed=seed, drop_last=drop_last, rank=rank, world_size=world_size)
        if isinstance(source, ShardSource):
            check_shard_arguments(source, read, decode)
            self.sampler: EpochSampler = ShardSampler(source, batch_size, **order)
        else:
            self.sampler = EpochSampler(len(source), batch_size, **order)
        self.epoch = 0
        self._order_identity = {**self.sampler.identity(), "source": source_digest(source)}
        self.stats = LoaderStats(io, threads, prefetch)
        self._write_trace: weakref.finalize | None = None
        if trace is not None:  # written at close(), or when the loader is collected or the program exits
            self.stats.tracer = Tracer(trace, trace_events)
            self._write_trace = weakref.finalize(self, self.stats.tracer.write)
        self._progress = Progress()  # what this epoch handed out to the user
        self._resume = False  # set by load_state_dict(): the next iteration continues the epoch
        self._run: EpochDriver | None = None
        self._closed = False
        self.progress = progress
        self._settings = Settings(
            source=source,
            read=read,
            decode=decode if decode is not None else ImageDecoder(),
            labelled=read is not False and len(source) > 0 and is_labelled(source[0]),
            batch_size=batch_size,
            drop_last=drop_last,
            num_threads=max(2 * cores, threads) if auto_threads else threads,
            io_concurrency=io,
            thread_gate=Gate(threads) if auto_threads else None,
            prefetch=prefetch,
            in_order=in_order,
            skip_errors=on_error == "skip",
            max_failures=max_failures,
            storage_options=storage_options,
            read_timeout=read_timeout,
            read_retries=read_retries,
            normalize=normalize,
            ring=BufferRing(keep=prefetch + 2, pin_memory=torch.cuda.is_available()),
            device_stage=DeviceStage(self.device, normalize) if self.device is not None else None,
            stats=self.stats,
        )
        count = process_count(processes, isolate)
        self._configure_known_layout(image_placement(self._settings.decode, self.device, count))
        self._window = window(prefetch, count)
        self._pipes: Pipes = LocalPipes(self._settings)
        if count:  # reads and decodes run in the children; the device stage and normalize here
            self._pipes = start_processes(count, self._settings, self.device, threads if auto_threads else None, threads)
            self.stats = self._settings.stats
        self.tuner = self._make_tuner(auto_threads, auto_io, threads, io, cores, count)

    def _make_tuner(self, auto_threads: bool, auto_io: bool, threads: int, io: int, cores: int,
                    processes: int) -> AutoTuner | None:
        """With ``"auto"`` settings, a tuner whose knobs act on the pipelines (totals over the
        processes, each taking its share)."""
        if not (auto_threads or auto_io):
            return None
        pipes, low = self._pipes, max(1, processes)
        thread_knob = (Knob("num_threads", threads, low, self._settings.num_threads,
                            apply=lambda value: pipes.set_limits(value, None)) if auto_threads else None)
        io_knob = Knob("io_concurrency", io, low, MAX_IO, apply=lambda value: pipes.set_limits(None, value)) if auto_io else None
        return AutoTuner(self.stats, thread_knob, io_knob)

    def _configure_known_layout(self, on_device: OnDevice | None) -> None:
        """With a decoder that declares its output (the default), buffers need no first sample.
        ``on_device``: a batched GPU decoder's image field lives on the GPU (labels stay on the host)."""
        output = getattr(self._settings.decode, "field", None)
        if isinstance(output, Field):
            tree, fields = (None, [output]) if not self._settings.labelled else ((None, None), [output, LABEL_FIELD])
            self._settings.ring.configure(SampleLayout(tree, fields), self.sampler.batch_size, on_device)

    def __len__(self) -> int:
        """Batches in one epoch for this rank."""
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        """Selects the shuffle of ``epoch`` (as ``DistributedSampler.set_epoch``)."""
        if epoch != self.epoch:
            self.epoch = epoch
            self._progress, self._resume = Progress(), False

    def __iter__(self) -> Iterator[Any]:
        if self._closed:
            raise RuntimeError("this AsyncLoader is closed")
        self._stop_run()  # a new iteration replaces an unfinished one
        if not self._resume:  # as with DataLoader, a new iteration starts the epoch afresh
            self._progress = Progress()
        self._resume = False
        order = self.sampler.order(self.epoch)[: self.sampler.samples_per_rank]
        run = EpochDriver(self._pipes, self._settings, self.epoch, order, self._progress, self._batch_quota(),
                          self._window)
        self._run = run
        iteration = self._iterate(run)
        # The threads start now (the first batch is under way before the first next()), but a
        # generator dropped before its first next() never runs its `finally`: stop them when
        # it goes, whether it ran or not.
        weakref.finalize(iteration, _stop_unless_stopped, run)
        return iteration

    def _batch_quota(self) -> BatchQuota | None:
        """With several ranks, every rank must deliver ``len(self)`` batches even when samples
        fail and are skipped, or DDP hangs at the epoch's end: the batches still owed and the
        size of the epoch's last one."""
        if self.sampler.world_size == 1:
            return None
        batches, size = len(self.sampler), self.sampler.batch_size
        last = size if self.sampler.drop_last else self.sampler.samples_per_rank - (batches - 1) * size
        return BatchQuota(batches - self._progress.batches, last)

    def _iterate(self, run: EpochDriver) -> Iterator[Any]:
        bar = ProgressBar(self.stats, self.sampler.samples_per_rank, self.epoch) if self.progress else None
        try:
            for positions, batch in run:  # the driver records what was handed out in self._progress
                if self.tuner is not None:
                    self.tuner.observe()
                if bar is not None:
                    bar.advance(len(positions))
                yield batch
                del batch  # not kept by this frame while the next one is awaited: its buffer may be reused
            self._progress = Progress()  # the epoch is complete
        finally:
            run.stop()
            if self._run is run and run._stop_done:  # else close() finishes the stop
                self._run = None
            if bar is not None:
                bar.close()

    def state_dict(self) -> dict[str, Any]:
        """Where this epoch stands: which positions of its order were handed out (as a few
        intervals: one, ``[0, n)``, unless samples were skipped or batches came out of order),
        which failed and were skipped, which were repeated as DDP padding."""
        return {
            "epoch": self.epoch,
            "seed": self.sampler.seed,
            "samples_per_rank": self.sampler.samples_per_rank,
            "batch_size": self.sampler.batch_size,
            "rank": self.sampler.rank,
            "world_size": self.sampler.world_size,
            **self._progress.as_state(),
            "order": dict(self._order_identity),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resumes from ``state_dict()``: the next iteration delivers what the epoch had not yet
        delivered, batch for batch as the uninterrupted run would have."""
        mine = self.state_dict()
        for key in ("seed", "samples_per_rank", "batch_size", "rank", "world_size"):
            if state[key] != mine[key]:
                raise ValueError(f"state_dict was saved with {key}={state[key]}, this loader has {mine[key]}")
        for key, value in state.get("order", mine["order"]).items():  # states saved before it had none
            if mine["order"].get(key) != value:
                raise ValueError(f"state_dict was saved with {key}={value!r}, this loader has "
                                 f"{mine['order'].get(key)!r}: resuming would follow another order")
        self.epoch = state["epoch"]
        self._progress, self._resume = Progress.from_state(state, self.sampler.batch_size), True

    def _stop_run(self) -> None:
        run = self._run
        if run is not None:
            run.stop()  # a Ctrl-C here leaves self._run set: the next close() finishes the stop
            if run._stop_done:
                self._run = None

    def close(self) -> None:
        """Stops every thread (and the child processes) and frees the batch buffers. Idempotent;
        a close cut short (Ctrl-C while it waits for the threads) is finished by the next."""
        self._closed = True
        self._stop_run()
        self._settings.ring.clear()
        close = getattr(self._pipes, "close", None)  # the child processes
        if close is not None:
            close()
        if self._write_trace is not None:
            self._write_trace()  # once: the children's events came with their answers

    def __enter__(self) -> "AsyncLoader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _stop_unless_stopped(run: Any) -> None:
    """A dropped iteration's run is stopped, unless its own ``finally`` already tried: a stop that
    timed out waited once, and garbage collection must not wait again (``close()`` finishes it)."""
    if not getattr(run, "_stopped", False):
        run.stop()
