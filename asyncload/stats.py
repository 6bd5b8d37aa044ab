"""Counters for each stage of the pipeline, cheap enough to be always on.

Busy seconds of a stage add up the time its items spent in it: for reads that overlap on the
event loop this exceeds wall time, which is the point: it shows how much waiting was hidden.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


@dataclass
class StageStats:
    """One stage: how many items passed, how long they spent in it, how many bytes they carried."""

    items: int = 0
    seconds: float = 0.0
    bytes: int = 0

    def as_dict(self) -> dict[str, float]:
        return {"items": self.items, "seconds": self.seconds, "bytes": self.bytes}


@dataclass
class Failure:
    """A sample that failed: which item, in which stage, and why."""

    item: object
    stage: str
    error: str


@dataclass
class LoaderStats:
    """Figures for the loader's lifetime (all epochs), updated from the loop, decode threads and
    the consumer."""

    read: StageStats = field(default_factory=StageStats)
    decode: StageStats = field(default_factory=StageStats)
    batches: int = 0
    samples: int = 0
    consumer_wait_seconds: float = 0.0
    retries: int = 0
    failures: list[Failure] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, stage: str, seconds: float, nbytes: int = 0) -> None:
        with self._lock:
            stats: StageStats = getattr(self, stage)
            stats.items += 1
            stats.seconds += seconds
            stats.bytes += nbytes

    def add_retry(self) -> None:
        with self._lock:
            self.retries += 1

    def add_failure(self, item: object, stage: str, error: BaseException) -> None:
        with self._lock:
            self.failures.append(Failure(item, stage, f"{type(error).__name__}: {error}"))

    def add_batch(self, samples: int, waited: float) -> None:
        with self._lock:
            self.batches += 1
            self.samples += samples
            self.consumer_wait_seconds += waited

    def as_dict(self) -> dict[str, float]:
        """A flat dict of plain numbers, for training logs."""
        with self._lock:
            wall = time.perf_counter() - self.started
            flat = {f"read/{k}": v for k, v in self.read.as_dict().items()}
            flat.update({f"decode/{k}": v for k, v in self.decode.as_dict().items()})
            flat.update(
                batches=self.batches,
                samples=self.samples,
                consumer_wait_seconds=self.consumer_wait_seconds,
                retries=self.retries,
                failures=len(self.failures),
                wall_seconds=wall,
            )
            return flat

    def report(self) -> str:
        """A compact table of the figures above."""
        d = self.as_dict()
        wall = max(d["wall_seconds"], 1e-9)
        lines = [
            f"{'stage':<10}{'items':>10}{'busy s':>10}{'ms/item':>10}{'MB':>10}",
        ]
        for stage in ("read", "decode"):
            items, seconds = d[f"{stage}/items"], d[f"{stage}/seconds"]
            per_item = 1000 * seconds / items if items else 0.0
            lines.append(
                f"{stage:<10}{items:>10}{seconds:>10.2f}{per_item:>10.2f}{d[f'{stage}/bytes'] / 1e6:>10.1f}"
            )
        lines.append(
            f"consumer: {d['batches']} batches, {d['samples']} samples, "
            f"waited {d['consumer_wait_seconds']:.2f} s of {wall:.2f} s "
            f"({100 * d['consumer_wait_seconds'] / wall:.0f} %); "
            f"retries {d['retries']}, failures {d['failures']}"
        )
        return "\n".join(lines)
