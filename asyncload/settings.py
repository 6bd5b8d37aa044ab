"""The loader's settings: one frozen value, made once from ``AsyncLoader``'s arguments by
``loader_settings``, which checks them (a wrong one fails at construction, named, rather than
later on a thread) and resolves their defaults (threads, reads in flight, the process count, the
decode, whether items carry labels). Every stage reads the fields it needs from this value where
it uses them: the pass and its driver, the backend, the pipeline and its reader, and each child
process, which gets the same value pickled (``for_children``) and takes its ``share`` of the
totals. Nothing copies it field by field, so a new parameter is its docstring in ``loader.py``,
a field and its check here, and the code that uses it.

What is built from the value, and lives while the loader runs, is not in it: the thread gate
the tuner moves, the device stage (a CUDA stream), the tracer, the ring of buffers are the
backend's or the loader's (``backend.py``).
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .decode.gpu import check_gpu_decode, decode_stage
from .decode.image import ImageDecoder
from .device import resolve_device
from .procs.choice import process_count
from .redact import redact_options, shown
from .sources.items import is_labelled
from .sources.mix import MixedSource
from .sources.shards import ShardSource
from .stats.machine import usable_cores

OBJECT_READS = 64  # default reads in flight, of single objects
SHARD_READS = 4  # default reads in flight for tar shards: ranged reads of up to chunk_bytes each
AUTO_OBJECT_READS = 16  # where "auto" starts for single objects (for shards: at SHARD_READS)
NO_LIMIT_ALLOWED = ("decode_timeout", "max_sample_bytes")  # None: no limit
HERE_ONLY = {"here_only": True}  # a field's metadata: runs in this process only, never sent to a child
SHOWN_ITEMS = 2  # a long sequence's repr shows its length and this many items


@dataclass(frozen=True)
class LoaderSettings:
    """The loader's arguments, checked and resolved (``loader.settings``). Frozen: what a pass,
    a pipeline or a child reads is what the loader was built with. Thread and read counts are
    totals; a child takes its ``share`` of them. Printable: ``repr`` summarises a long source
    and names callables."""

    source: Sequence[Any]
    batch_size: int
    shuffle: bool
    seed: int
    drop_last: bool
    read: Callable[[Any], Any] | bool | None
    decode: Callable[[Any], Any]  # resolved: the user's, ImageDecoder(), a source's default, or the GPU stage
    labelled: bool  # the items are (key, int label) pairs: each sample carries its label
    num_threads: int  # decode threads working at first (the user's, else one per usable CPU)
    auto_threads: bool  # num_threads="auto": the tuner moves how many work, up to threads_started
    threads_started: int  # decode threads started: num_threads, or with "auto" room for the tuner
    io_concurrency: int  # reads in flight at first (the user's, else the source kind's default)
    auto_io: bool  # io_concurrency="auto": the tuner moves it
    prefetch: int
    in_order: bool
    device: torch.device | None  # resolved: a CUDA device, or None for pinned CPU tensors
    on_error: str
    storage_options: dict[str, Any] | None
    rank: int | None  # as given (None: from torch.distributed or the environment, settled per pass)
    world_size: int | None
    max_failures: int | float
    progress: bool
    normalize: tuple[Sequence[float], Sequence[float]] | None = field(metadata=HERE_ONLY)  # the device stage's
    read_timeout: float
    read_retries: int | None
    read_retry_seconds: float
    max_sample_bytes: int | None
    decode_timeout: float | None
    processes: int  # children to start with (isolate=True is 1); 0: this process
    adaptive: bool  # processes=None: may move reads and decode into children later (switch.py)
    trace: str | os.PathLike | None
    trace_events: int
    collate: Callable[[Any], Any] | None = field(metadata=HERE_ONLY)  # at hand-out, in this process
    gpu_decode: bool | str  # as given; ``decode`` is what it chose
    source_names: tuple[str, ...] | None  # a mix's: each sample then carries its source's number

    @property
    def skip_errors(self) -> bool:
        return self.on_error == "skip"

    def for_children(self) -> dict[str, Any]:
        """The value as a child process gets it, by field (each is pickled alone, so that one
        that cannot be is named: ``procs/protocol.py``); what runs only here (``collate``) is left
        out, so that a child never needs what only this process can import."""
        return {f.name: None if f.metadata.get("here_only") else getattr(self, f.name) for f in fields(self)}

    def __repr__(self) -> str:
        shown_fields = ", ".join(f"{f.name}={summary(f.name, getattr(self, f.name))}" for f in fields(self))
        return f"LoaderSettings({shown_fields})"


def share(total: int, processes: int) -> int:
    """One process's part of a total of threads or reads (rounded up: none gets zero); the
    total in this process (``processes`` 0) or in a single child."""
    return total if processes <= 1 else max(1, math.ceil(total / processes))


def summary(name: str, value: Any) -> str:
    """A field as ``repr`` shows it: bounded and without secrets (``redact.py``); a long sequence
    as its length and first items, a function or class by its name, an object without a repr of
    its own by its type."""
    if name == "storage_options":
        return shown(redact_options(value))
    if isinstance(value, (list, tuple, np.ndarray)) and len(value) > SHOWN_ITEMS:
        first = value[:SHOWN_ITEMS].tolist() if isinstance(value, np.ndarray) else value[:SHOWN_ITEMS]
        items = ", ".join(shown(item, 60) for item in first)
        return f"<{type(value).__name__} of {len(value):,} items: {items}, ...>"
    if callable(value) and hasattr(value, "__qualname__"):
        return value.__qualname__
    if type(value).__repr__ is object.__repr__:
        return f"<{type(value).__qualname__}>"
    return shown(value)


def loader_settings(source: Sequence[Any], batch_size: int, shuffle: bool, seed: int, drop_last: bool, read: Any,
                    decode: Any, num_threads: int | str | None, io_concurrency: int | str | None, prefetch: int,
                    in_order: bool, device: str | torch.device | None, on_error: str,
                    storage_options: dict[str, Any] | None, rank: int | None, world_size: int | None,
                    max_failures: int | float, progress: bool, normalize: Any, read_timeout: float,
                    read_retries: int | None, read_retry_seconds: float, max_sample_bytes: int | None,
                    decode_timeout: float | None, isolate: bool, processes: int | str | None,
                    trace: str | os.PathLike | None, trace_events: int, collate: Any,
                    gpu_decode: bool | str) -> LoaderSettings:
    """``AsyncLoader``'s arguments (all of them, as its docstring describes them) checked and
    resolved into the value every stage reads. Fails at construction, naming the argument."""
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    if io_concurrency not in (None, "auto") and (not isinstance(io_concurrency, int) or io_concurrency < 1):
        raise ValueError(f"io_concurrency must be a positive integer, 'auto' or None, got {io_concurrency!r}")
    if num_threads not in (None, "auto") and not (whole(num_threads) and num_threads >= 1):
        raise ValueError(f"num_threads must be a positive integer, 'auto' or None, got {num_threads!r}")
    if not whole(prefetch) or prefetch < 1:
        raise ValueError(f"prefetch must be an integer of at least 1, got {prefetch!r}")
    if not whole(seed):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    if read_retries is not None and not (whole(read_retries) and read_retries >= 0):
        raise ValueError(f"read_retries must be None or a non-negative integer, got {read_retries!r}")
    if read is True or (read not in (None, False) and not callable(read)):
        raise TypeError(f"read must be None, False or a callable, got {read!r}")
    if isinstance(max_failures, float) and not 0 <= max_failures < 1:
        raise ValueError(f"max_failures as a fraction must be in [0, 1), got {max_failures}")
    if isinstance(max_failures, int) and max_failures < 0:
        raise ValueError(f"max_failures must not be negative, got {max_failures}")
    for name, value in dict(decode_timeout=decode_timeout, max_sample_bytes=max_sample_bytes,
                            read_retry_seconds=read_retry_seconds, read_timeout=read_timeout).items():
        check_positive(name, value)
    cores = usable_cores()
    auto_threads = num_threads == "auto"
    threads = cores if auto_threads or num_threads is None else int(num_threads)
    resolved_device = resolve_device(device)
    if isinstance(source, ShardSource):  # a mix of shard sources too
        check_shard_arguments(source, read, decode)
    count = process_count(processes, isolate)
    return LoaderSettings(
        source=source, batch_size=batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last, read=read,
        decode=default_decode(source, decode, resolved_device, gpu_decode, count),
        labelled=read is not False and len(source) > 0 and is_labelled(source[0]),
        num_threads=threads, auto_threads=auto_threads,
        threads_started=max(2 * cores, threads) if auto_threads else threads,  # the tuner's room
        io_concurrency=initial_reads(io_concurrency, isinstance(source, ShardSource)),
        auto_io=io_concurrency == "auto", prefetch=prefetch, in_order=in_order, device=resolved_device,
        on_error=on_error, storage_options=storage_options, rank=rank, world_size=world_size,
        max_failures=max_failures, progress=progress, normalize=normalize, read_timeout=read_timeout,
        read_retries=read_retries, read_retry_seconds=read_retry_seconds, max_sample_bytes=max_sample_bytes,
        decode_timeout=decode_timeout, processes=count, adaptive=processes in (None, "auto") and not count,
        trace=trace, trace_events=trace_events, collate=collate, gpu_decode=gpu_decode,
        source_names=source.names if isinstance(source, MixedSource) else None,
    )


def whole(value: Any) -> bool:
    """An integer (NumPy's too), not a bool: what counts, seeds and batch numbers must be."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_positive(name: str, value: Any) -> None:
    """A budget (seconds, bytes) must be a positive number; None means no limit where
    ``NO_LIMIT_ALLOWED`` says it may."""
    if name in NO_LIMIT_ALLOWED and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        none = " or None" if name in NO_LIMIT_ALLOWED else ""
        raise ValueError(f"{name} must be a positive number{none}, got {value!r}")


def check_shard_arguments(source: ShardSource, read: Any, decode: Any) -> None:
    """A shard source is read by the loader; with every member, only the user knows how to decode."""
    if read is not None:
        raise ValueError("a shard source is read by the loader itself: leave read=None")
    if source.members == "all" and decode is None and not hasattr(source, "default_decode"):
        raise ValueError("tar_shards(..., members='all') gives each sample as {extension: bytes}: pass a decode= for it")


def initial_reads(io_concurrency: int | str | None, shards: bool) -> int:
    """Reads in flight to start with: the user's number, else the default for the source's kind
    of read; "auto" starts low for single objects and grows while storage is the bottleneck."""
    if isinstance(io_concurrency, int):
        return io_concurrency
    if shards:
        return SHARD_READS
    return AUTO_OBJECT_READS if io_concurrency == "auto" else OBJECT_READS


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
