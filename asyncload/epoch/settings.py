"""What a pass over the loader needs from it, decided once per loader: the source and how to
read and decode it, the failure policy, the hand-out (order, normalize, the device stage) and the
totals of threads and reads that the pipelines share.

A pass holds these settings, never the loader, so that dropping the loader is never delayed by a
running thread holding it. The epoch's sizes (``drop_last`` among them) are the sampler's
(``order/epoch_size.py``); the ring and the stats are the backend's (``backend.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..device import DeviceStage
from ..gates import Gate
from ..pipeline.settings import PipelineSettings, share


@dataclass
class Settings:
    """What an epoch run needs from the loader (not the loader itself, so that dropping the
    loader is never delayed by a running thread holding it)."""

    source: Sequence[Any]
    read: Callable[[Any], Any] | bool | None
    decode: Callable[[Any], Any]
    labelled: bool
    batch_size: int
    num_threads: int  # decode threads started (the most the tuner may use)
    io_concurrency: int  # reads in flight to start with (the tuner moves the pipelines' own)
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
    device_stage: DeviceStage | None
    source_names: tuple[str, ...] | None = None  # a mix's: each sample then carries its source's number
    collate: Callable[[Any], Any] | None = None  # the user's, once per batch at hand-out

    def pipeline(self, processes: int = 0, thread_limit: int | None = None,
                 trace_events: int | None = None) -> PipelineSettings:
        """What one pipeline needs; with ``processes`` children, its share of the totals.
        ``trace_events``: with a trace, how many events a child keeps to send with its answers."""
        return PipelineSettings(
            source=self.source, read=self.read, decode=self.decode, labelled=self.labelled,
            batch_size=self.batch_size, num_threads=share(self.num_threads, processes),
            io_concurrency=share(self.io_concurrency, processes),
            thread_limit=None if thread_limit is None else share(thread_limit, processes),
            storage_options=self.storage_options, read_timeout=self.read_timeout, read_retries=self.read_retries,
            read_retry_seconds=self.read_retry_seconds, max_sample_bytes=self.max_sample_bytes,
            decode_timeout=self.decode_timeout, trace_events=trace_events,
        )
