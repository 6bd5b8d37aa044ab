"""A typed snapshot of the loader's figures (``loader.stats.snapshot()``), one dataclass field a
figure with what it means, as SPDL's ``TaskPerfStats``; ``as_dict()`` flattens it to the
``"stage/figure"`` keys of training logs and the benchmark's JSON, ``from_dict`` reads them back
(a child process sends its figures as such a dict).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

STAGES = ("read", "decode", "write", "copy")  # copy: host-to-device, with device="cuda"
LEVELS = ("reads_in_flight", "decodes_running", "batches_ready", "producer_waiting")


@dataclass(frozen=True)
class StageFigures:
    """One stage over the loader's lifetime (busy seconds add up per item, so overlapping reads
    can exceed wall time: that shows how much waiting was hidden)."""

    items: int = 0
    """Items that passed: reads (one per object, or per ranged read of a shard), decoded
    samples, rows written by copy, batches copied to the device."""
    seconds: float = 0.0
    """Time the items spent in the stage, summed over items."""
    bytes: int = 0
    """Bytes the items carried (read: bytes received; copy: bytes sent to the device)."""
    cpu_seconds: float = 0.0
    """CPU time of the threads doing the work (decode only): beside ``seconds``, it tells a
    decode waiting for the GIL (wall time, no CPU) from one that computes."""


@dataclass(frozen=True)
class LevelFigures:
    """A quantity that rises and falls, over the time an epoch was running."""

    mean: float = 0.0
    """Time-weighted mean over the active seconds."""
    peak: int = 0
    """Highest value seen."""


@dataclass(frozen=True)
class StatsSnapshot:
    """The loader's figures at one moment, over its lifetime (means over the time an epoch ran)."""

    read: StageFigures
    """Reads of objects, files or shard chunks."""
    decode: StageFigures
    """Decodes (and transforms) of samples, with their threads' CPU time."""
    write: StageFigures
    """Copies of decoded samples into batch rows (decoders without ``decode_into``)."""
    copy: StageFigures
    """Host-to-device copies of batches (with a CUDA ``device``): host time to issue them."""
    reads_in_flight: LevelFigures
    """Reads started and not finished, against ``io_concurrency``."""
    decodes_running: LevelFigures
    """Decodes under way, against ``num_threads``."""
    batches_ready: LevelFigures
    """Complete batches waiting for the user, against ``prefetch``."""
    producer_waiting: LevelFigures
    """1 while the producer waits for room in the prefetch window (then memory is the limit)."""
    gil_late_ms: float
    """Mean lateness of a probe thread waking every 5 ms: ~0.1 ms when the GIL is free."""
    batches: int
    """Batches handed out."""
    samples: int
    """Samples in those batches."""
    consumer_wait_seconds: float
    """Time the user's loop waited for a batch."""
    retries: int
    """Reads retried after a transient failure."""
    retry_wait_seconds: float
    """Time those retries waited before trying again (backoff): how much of the retry budget
    (``read_retry_seconds``) storage outages and throttling have cost."""
    failures: int
    """Samples that failed (read, decode or source), skipped or raised."""
    active_seconds: float
    """Wall time during which an epoch was running."""
    cpu_seconds: float
    """CPU time of this process (and its children's, with ``processes=N``) while active."""
    other_processes_cpu_seconds: float
    """CPU time the rest of the machine used meanwhile: contention, not the GIL."""
    cpu_cores: int
    """Cores this process may run on."""
    io_concurrency: int
    """Reads allowed in flight (the tuner's current value with ``"auto"``)."""
    num_threads: int
    """Decode threads allowed to work (the tuner's current value with ``"auto"``)."""
    prefetch: int
    """Batches the producer may be ahead of the user."""
    bottleneck: str = "unknown"
    """What limits the pipeline (see ``stats.verdict.diagnose``)."""
    processes: int | None = None
    """Child processes running the pipeline, with ``processes=N``; else None."""
    decoded_on_cpu: int = 0
    """Samples a batched GPU decoder (``GpuImageDecoder``) sent to its CPU path: formats and files
    nvJPEG does not decode (CMYK JPEGs, PNG, ...). Near ``decode.items``, the GPU path idles. By
    reason: ``LoaderStats.decoded_on_cpu_why`` and ``as_dict()["decoded_on_cpu/<reason>"]``."""
    aside_bytes: int = 0
    """Bytes of sample values kept aside rather than in the batch's arrays (``batch/ragged.py``):
    text, objects, list fields (arrays whose other dimensions vary), rows past a ragged field's
    room. With ``processes=N`` these travel pickled in the child's answer, per sample."""

    def as_dict(self) -> dict[str, Any]:
        """Plain numbers (and the bottleneck's name), for training logs or TensorBoard: keys
        ``"read/items"``, ``"reads_in_flight/mean"``, ``"batches"``, ..."""
        out: dict[str, Any] = {}
        for name in STAGES:
            stage = getattr(self, name)
            out.update({f"{name}/items": stage.items, f"{name}/seconds": stage.seconds, f"{name}/bytes": stage.bytes})
        out["decode/cpu_seconds"] = self.decode.cpu_seconds
        out["gil/late_ms"] = self.gil_late_ms
        for name in LEVELS:
            level = getattr(self, name)
            out[f"{name}/mean"], out[f"{name}/peak"] = level.mean, level.peak
        for f in fields(self):
            if f.name not in STAGES and f.name not in LEVELS and f.name not in ("gil_late_ms", "processes"):
                out[f.name] = getattr(self, f.name)
        if self.processes is not None:
            out["processes"] = self.processes
        return out

    @classmethod
    def from_dict(cls, figures: dict[str, Any]) -> "StatsSnapshot":
        """The snapshot whose ``as_dict()`` is ``figures``."""
        stages = {name: StageFigures(figures[f"{name}/items"], figures[f"{name}/seconds"], figures[f"{name}/bytes"],
                                     figures["decode/cpu_seconds"] if name == "decode" else 0.0) for name in STAGES}
        levels = {name: LevelFigures(figures[f"{name}/mean"], figures[f"{name}/peak"]) for name in LEVELS}
        plain = {f.name: figures[f.name] for f in fields(cls)
                 if f.name not in stages and f.name not in levels and f.name in figures}
        return cls(**stages, **levels, gil_late_ms=figures["gil/late_ms"], **plain)
