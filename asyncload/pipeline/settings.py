"""What a run needs from the loader, decided once per loader: the policy (order, errors), the
resources (threads, reads in flight, the buffer ring, the device stage) and the shared stats.

A run holds these settings, never the loader, so that dropping the loader is never delayed by
a running thread holding it. ``PipelineSettings`` is the part that moves samples: what a
pipeline needs, in this process or (pickled) in a child process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ..autotune import Gate
from ..batch.buffers import BufferRing, OnDevice
from ..batch.layout import Field, SampleLayout
from ..device import DeviceStage
from ..errors import SampleError
from ..io.reader import Reader
from ..sources.items import is_labelled
from ..sources.mix_source import MixedSource
from ..sources.shards import ShardSource
from ..stats.figures import LoaderStats

LABEL_FIELD = Field((), np.dtype(np.int64))


def split(source: Sequence[Any], labelled_items: bool, index: int) -> tuple[Any, Any]:
    """The source item at ``index`` -> (what to read, label or None). In a mix, the label is a
    tuple of the extra int64 fields the rows take: ``(label, source number)``, or
    ``(source number,)`` for unlabelled items (``jobs.write_label`` writes them)."""
    number = None
    if isinstance(source, MixedSource):
        part, local, number = source.locate(index)
        if not isinstance(source, ShardSource):  # a shard mix's own items carry the mix's index: its stream reads by it
            source, index = part, local
    try:
        item = source[index]
    except Exception as error:
        raise SampleError(f"source[{index}]", "source", error) from error
    label = None
    if labelled_items:
        if not is_labelled(item):
            raise SampleError(item, "source", TypeError("expected a (url, label) pair like the first item"))
        item, label = item[0], int(item[1])
    if number is None:
        return item, label
    return item, (number,) if label is None else (label, number)


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
    read_retries: int | None
    read_retry_seconds: float
    max_sample_bytes: int | None
    decode_timeout: float | None
    normalize: tuple[Sequence[float], Sequence[float]] | None
    ring: BufferRing
    device_stage: DeviceStage | None
    stats: LoaderStats
    source_names: tuple[str, ...] | None = None  # a mix's: each sample then carries its source's number

    def pipeline(self, processes: int = 0, thread_limit: int | None = None) -> "PipelineSettings":
        """What one pipeline needs; with ``processes`` children, its share of the totals."""
        return PipelineSettings(
            source=self.source, read=self.read, decode=self.decode, labelled=self.labelled,
            batch_size=self.batch_size, num_threads=share(self.num_threads, processes),
            io_concurrency=share(self.io_concurrency, processes),
            thread_limit=None if thread_limit is None else share(thread_limit, processes),
            storage_options=self.storage_options, read_timeout=self.read_timeout, read_retries=self.read_retries,
            read_retry_seconds=self.read_retry_seconds, max_sample_bytes=self.max_sample_bytes,
            decode_timeout=self.decode_timeout,
            trace_events=None if self.stats.tracer is None else self.stats.tracer.events.maxlen,
        )


@dataclass
class PipelineSettings:
    """What moves samples: the source, how to read and decode it, and the resources for it
    (a child process gets its share of ``num_threads`` and ``io_concurrency``). No policy: which
    samples go where, and what a failure means, are the driver's (``driver.py``)."""

    source: Sequence[Any]
    read: Callable[[Any], Any] | bool | None
    decode: Callable[[Any], Any]
    labelled: bool
    batch_size: int
    num_threads: int
    io_concurrency: int
    thread_limit: int | None  # with num_threads="auto": decode threads that may work at once
    storage_options: dict[str, Any] | None
    read_timeout: float
    read_retries: int | None
    read_retry_seconds: float
    max_sample_bytes: int | None
    decode_timeout: float | None = None  # seconds a decode may run before its sample fails (slots.py)
    trace_events: int | None = None  # with trace=: a child records its events and sends them with its answers

    async def reader(self, loop: Any, stats: Any) -> Reader:
        """The pipeline's reader (made on its event loop, ``loop``)."""
        return Reader(loop, storage_options=self.storage_options, timeout=self.read_timeout, retries=self.read_retries,
                      io_concurrency=self.io_concurrency, stats=stats, user_read=self.read if callable(self.read) else None,
                      retry_seconds=self.read_retry_seconds, max_bytes=self.max_sample_bytes)


def share(total: int, processes: int) -> int:
    """One process's part of a total (rounded up: none gets zero); the total in-process."""
    return total if processes <= 1 else max(1, math.ceil(total / processes))


@dataclass(frozen=True)
class BatchQuota:
    """How many batches a run must deliver whatever fails (``count``), the last one with
    ``last_size`` rows: ranks of a DDP job must all deliver the same number of batches."""

    count: int
    last_size: int


def batch_quota(sampler: Any, batches_done: int) -> BatchQuota | None:
    """With several ranks, every rank must deliver ``len(sampler)`` batches even when samples
    fail and are skipped, or DDP hangs at the epoch's end: the batches still owed (of which
    ``batches_done`` were handed out) and the size of the epoch's last one."""
    if sampler.world_size == 1:
        return None
    batches, size = len(sampler), sampler.batch_size
    last = size if sampler.drop_last else sampler.samples_per_rank - (batches - 1) * size
    return BatchQuota(batches - batches_done, last)


def configure_known_layout(settings: Settings, batch_size: int, on_device: OnDevice | None) -> None:
    """With a decoder that declares its output (the default), buffers need no first sample.
    ``on_device``: a batched GPU decoder's image field lives on the GPU (labels stay on the host)."""
    output = getattr(settings.decode, "field", None)
    if isinstance(output, Field):
        extra = [LABEL_FIELD] * (int(settings.labelled) + int(settings.source_names is not None))  # label, source
        tree, fields = (None, [output]) if not extra else ((None,) * (1 + len(extra)), [output, *extra])
        settings.ring.configure(SampleLayout(tree, fields), batch_size, on_device)
