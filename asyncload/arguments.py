"""The loader's arguments: their checks and defaults, apart from ``AsyncLoader`` so that the
class reads as what it does.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .autotune import MAX_IO, AutoTuner, Knob
from .decode.gpu import check_gpu_decode, decode_stage
from .decode.image import ImageDecoder
from .device import DeviceStage
from .epoch.settings import Settings
from .gates import Gate
from .order.mix_order import MixSampler
from .order.sampler import EpochSampler
from .order.shard_order import ShardSampler
from .pipeline.pipes import Pipes
from .sources.items import is_labelled
from .sources.mix_source import MixedSource
from .sources.shards import ShardSource
from .stats.figures import LoaderStats

OBJECT_READS = 64  # default reads in flight, of single objects
SHARD_READS = 4  # default reads in flight for tar shards: ranged reads of up to chunk_bytes each
AUTO_OBJECT_READS = 16  # where "auto" starts for single objects (for shards: at SHARD_READS)


def initial_reads(io_concurrency: int | str | None, shards: bool) -> int:
    """Reads in flight to start with: the user's number, else the default for the source's kind
    of read; "auto" starts low for single objects and grows while storage is the bottleneck."""
    if isinstance(io_concurrency, int):
        return io_concurrency
    if shards:
        return SHARD_READS
    return AUTO_OBJECT_READS if io_concurrency == "auto" else OBJECT_READS


NO_LIMIT_ALLOWED = ("decode_timeout", "max_sample_bytes")  # None: no limit


def check_arguments(on_error: str, io_concurrency: int | str | None, prefetch: int, read: Any, max_failures: int | float,
                    limits: dict[str, float | None]) -> None:
    """Fails at construction, naming the argument, rather than later on a thread. ``limits``:
    the budgets (seconds, bytes) that must be positive, or None where None means no limit."""
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    if io_concurrency not in (None, "auto") and (not isinstance(io_concurrency, int) or io_concurrency < 1):
        raise ValueError(f"io_concurrency must be a positive integer, 'auto' or None, got {io_concurrency!r}")
    if prefetch < 1:
        raise ValueError(f"prefetch must be at least 1, got {prefetch}")
    if read is True or (read not in (None, False) and not callable(read)):
        raise TypeError(f"read must be None, False or a callable, got {read!r}")
    if isinstance(max_failures, float) and not 0 <= max_failures < 1:
        raise ValueError(f"max_failures as a fraction must be in [0, 1), got {max_failures}")
    if isinstance(max_failures, int) and max_failures < 0:
        raise ValueError(f"max_failures must not be negative, got {max_failures}")
    for name, value in limits.items():
        if name in NO_LIMIT_ALLOWED and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            none = " or None" if name in NO_LIMIT_ALLOWED else ""
            raise ValueError(f"{name} must be a positive number{none}, got {value!r}")


def check_shard_arguments(source: ShardSource, read: Any, decode: Any) -> None:
    """A shard source is read by the loader; with every member, only the user knows how to decode."""
    if read is not None:
        raise ValueError("a shard source is read by the loader itself: leave read=None")
    if source.members == "all" and decode is None and not hasattr(source, "default_decode"):
        raise ValueError("tar_shards(..., members='all') gives each sample as {extension: bytes}: pass a decode= for it")


def make_sampler(source: Sequence[Any], batch_size: int, read: Any, decode: Any, **order: Any) -> EpochSampler:
    """The epoch's order over ``source``: a tar shard source's keeps each rank on a few shards; a
    mix's is its seeded mixed sequence."""
    if isinstance(source, ShardSource):  # a mix of shard sources too
        check_shard_arguments(source, read, decode)
    if isinstance(source, MixedSource):
        return MixSampler(source, batch_size, **order)
    if isinstance(source, ShardSource):
        return ShardSampler(source, batch_size, **order)
    return EpochSampler(len(source), batch_size, **order)


def make_tuner(stats: LoaderStats, pipes: Pipes, most_threads: int, auto_threads: bool, auto_io: bool,
               threads: int, io: int, processes: int) -> AutoTuner | None:
    """With ``"auto"`` settings, a tuner whose knobs act on the pipelines (totals over the
    processes, each taking its share): threads from ``threads`` up to the ``most_threads`` started,
    reads in flight from ``io``."""
    if not (auto_threads or auto_io):
        return None
    low = max(1, processes)
    thread_knob = (Knob("num_threads", threads, low, most_threads, apply=lambda value: pipes.set_limits(value, None))
                   if auto_threads else None)
    io_knob = Knob("io_concurrency", io, low, MAX_IO, apply=lambda value: pipes.set_limits(None, value)) if auto_io else None
    return AutoTuner(stats, thread_knob, io_knob)


def default_decode(source: Sequence[Any], decode: Any, device: torch.device | None = None,
                   gpu_decode: bool | str = "auto", processes: int = 0) -> Any:
    """The decode the runs use: the user's or ``ImageDecoder()``, as the GPU decode stage where
    ``decode_stage`` takes it (a CUDA ``device``); for Parquet rows with ``columns``, that image
    decode with the columns beside it (``{"image": ..., name: ...}``). Neither of those two is
    the stage's (it decodes one image per row, not a sample of columns): ``gpu_decode=True``
    there is an error rather than ignored."""
    check_gpu_decode(gpu_decode)
    if decode is None and hasattr(source, "default_decode"):  # mds / litdata: image + label columns
        if gpu_decode is True:
            raise ValueError(f"gpu_decode=True needs the default ImageDecoder; {type(source).__name__}'s default "
                             "decode reads its image and label columns, which the GPU stage does not: "
                             "pass gpu_decode='auto' or False")
        return source.default_decode()
    decode = decode if decode is not None else ImageDecoder()
    if getattr(source, "columns", None) and isinstance(source, ShardSource):
        if gpu_decode is True:
            raise ValueError("gpu_decode=True needs the default ImageDecoder alone; Parquet columns= decode each "
                             "row's image with its columns beside it, which the GPU stage does not: "
                             "drop columns= or pass gpu_decode='auto' or False")
        from .sources.parquet import ColumnsDecoder

        return ColumnsDecoder(decode)
    return decode_stage(decode, device, gpu_decode, processes)


def make_settings(source: Sequence[Any], read: Any, decode: Any, *, batch_size: int, threads: int,
                  cores: int, auto_threads: bool, io: int, prefetch: int, in_order: bool, on_error: str,
                  max_failures: int | float, storage_options: dict[str, Any] | None, read_timeout: float,
                  read_retries: int | None, read_retry_seconds: float, max_sample_bytes: int | None,
                  decode_timeout: float | None, normalize: Any, device: torch.device | None,
                  collate: Any = None, gpu_decode: bool | str = "auto", processes: int = 0) -> Settings:
    """What the runs need from the loader's arguments. With ``num_threads="auto"`` twice the
    cores are started and a gate lets ``threads`` of them work (the tuner moves it)."""
    return Settings(
        source=source, read=read, decode=default_decode(source, decode, device, gpu_decode, processes),
        labelled=read is not False and len(source) > 0 and is_labelled(source[0]),
        batch_size=batch_size,
        num_threads=max(2 * cores, threads) if auto_threads else threads, io_concurrency=io,
        thread_gate=Gate(threads) if auto_threads else None, prefetch=prefetch, in_order=in_order,
        skip_errors=on_error == "skip", max_failures=max_failures, storage_options=storage_options,
        read_timeout=read_timeout, read_retries=read_retries, read_retry_seconds=read_retry_seconds,
        max_sample_bytes=max_sample_bytes, decode_timeout=decode_timeout, normalize=normalize,
        device_stage=DeviceStage(device, normalize) if device is not None else None,
        source_names=source.names if isinstance(source, MixedSource) else None, collate=collate,
    )
