"""What a contender is, and the data a run hands it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Iterable

from bench.harness.workloads import Workload


@dataclass
class RunData:
    """Where a run's samples are. `items` are (url, label) pairs, the same list (in the same
    order) for every contender; `root` is the folder or bucket prefix they came from."""

    root: str = ""
    items: list[tuple[str, int]] = field(default_factory=list)
    storage_options: dict | None = None
    device: str = "cpu"


class Contender:
    """A data-loading library under test."""

    name = ""
    # Is this the baseline that ratios are computed against?
    baseline = False
    # Workloads left out of this contender's runs (python-step weighs isolate=True against
    # DataLoader's processes; the thread-based contenders add nothing there but minutes).
    skipped: tuple[str, ...] = ()

    def unavailable(self) -> str | None:
        """None when it can run here, else the reason (an exception's text)."""
        return None

    def supports(self, workload: Workload) -> bool:
        """Whether this contender has a reader for the workload's data (tar shards need one)."""
        return not workload.samples_per_shard and workload.name not in self.skipped

    def configs(self, workload: Workload, quick: bool) -> list[dict]:
        """The sweep for this workload: a list of settings, the first being the defaults."""
        raise NotImplementedError

    def label(self, config: dict) -> str:
        """A short row name for the report."""
        settings = " ".join(f"{k}={v}" for k, v in config.items() if k != "tag")
        return " ".join(part for part in (self.name, config.get("tag", ""), settings) if part)

    def build(self, workload: Workload, config: dict, data: RunData) -> Any:
        """An object with __iter__ (one epoch of batches), set_epoch(e) and close()."""
        raise NotImplementedError

    defaults: dict = {}  # settings a config leaves out, for the plot

    def sweep_value(self, config: dict) -> int | None:
        """The number of workers/threads, the x axis of the plot."""
        full = {**self.defaults, **config}
        return full.get("num_workers", full.get("num_threads"))

    def series(self, config: dict) -> str:
        """The plot line a config belongs to: the contender and its settings but the swept one."""
        full = {**self.defaults, **config}
        rest = [f"{k}={v}" for k, v in full.items() if k not in ("num_workers", "num_threads", "tag")]
        return " ".join([self.name, *rest])


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def batch_size_of(batch: Any) -> int:
    """Samples in a batch, whatever its structure: (images, labels), a tensor, or a dict."""
    if isinstance(batch, dict):
        batch = next(iter(batch.values()))
    if isinstance(batch, (tuple, list)):
        batch = batch[0]
    return int(batch.shape[0])


class EpochIterable:
    """Wraps a per-epoch factory as a loader: iter() builds a fresh pass for the current epoch."""

    def __init__(self, make_epoch, close=None) -> None:
        self._make_epoch = make_epoch
        self._close = close
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterable:
        return iter(self._make_epoch(self.epoch))

    def close(self) -> None:
        if self._close is not None:
            self._close()
