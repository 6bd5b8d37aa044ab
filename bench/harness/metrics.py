"""What a run costs, measured over the whole process tree (the loader's worker processes included).

A loader that moves work into child processes must be charged for them, so CPU time and memory are
summed over the process and all its descendants. Memory is sampled by a background thread because
the peak is what decides whether a job fits on a machine, and it only exists for a moment.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field

import psutil


def _tree(root: psutil.Process) -> list[psutil.Process]:
    try:
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return [root]


def tree_cpu_seconds(root: psutil.Process | None = None) -> float:
    """User+system CPU seconds of the process, its live descendants and its reaped children.

    Live descendants are read directly; children that already exited are in the root's children_*
    fields, so a worker that stops between two readings still gets counted."""
    root = root or psutil.Process()
    total = 0.0
    for proc in _tree(root):
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
        if proc.pid == root.pid:
            total += times.children_user + times.children_system
    return total


def tree_memory(root: psutil.Process, pss: bool) -> tuple[int, int]:
    """(sum of RSS, sum of PSS or 0) over the tree in bytes.

    RSS double-counts pages shared between processes (libraries, shared-memory batches), so PSS,
    which splits each shared page among its users, is the fairer sum; it is read from
    /proc/<pid>/smaps_rollup."""
    rss = pss_total = 0
    for proc in _tree(root):
        try:
            if pss:
                info = proc.memory_full_info()
                pss_total += getattr(info, "pss", 0)
            else:
                info = proc.memory_info()
            rss += info.rss
        except psutil.Error:
            continue
    return rss, pss_total


class TreeSampler(threading.Thread):
    """Samples the tree's RSS every `interval` seconds, and its PSS every `pss_every` samples.

    Reading PSS makes the kernel walk every page table (~3 ms per torch process here), which at
    50 ms would itself cost a tenth of a core per process, so PSS is sampled more sparsely."""

    def __init__(self, interval: float = 0.05, pss_every: int = 20) -> None:
        super().__init__(name="bench-memory-sampler", daemon=True)
        self.interval = interval
        self.pss_every = pss_every
        self.peak_rss = 0
        self.peak_pss = 0
        self.samples = 0
        self._stop_event = threading.Event()
        self._root = psutil.Process()

    def sample(self) -> None:
        rss, pss = tree_memory(self._root, pss=self.samples % self.pss_every == 0)
        self.peak_rss = max(self.peak_rss, rss)
        self.peak_pss = max(self.peak_pss, pss)
        self.samples += 1

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            self.sample()

    def stop(self) -> None:
        self._stop_event.set()
        self.join()
        self.samples = 0  # the final sample reads PSS as well
        self.sample()


@dataclass
class EpochStats:
    """One pass over the data as the consumer saw it."""

    samples: int
    batches: int
    wall_s: float
    wait_s: float  # time blocked in next(iterator), the first batch included
    first_batch_s: float  # from iter(loader) to the first batch in hand
    cpu_s: float  # tree CPU seconds spent during the epoch
    step_s: float  # time spent in the simulated (or real) training step
    batch_wait_s: list[float] = field(default_factory=list)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else 0.0


def summarise(epochs: list[EpochStats], warmup: EpochStats) -> dict:
    """The figures reported for one run: medians over measured epochs, first batch from the cold
    (warm-up) epoch, since that is the one a user waits for."""
    total_samples = sum(e.samples for e in epochs)
    total_wall = sum(e.wall_s for e in epochs)
    steady_wait = sum(sum(e.batch_wait_s[1:]) for e in epochs)
    steady_wall = total_wall - sum(e.batch_wait_s[0] for e in epochs if e.batch_wait_s)
    batches = sum(e.batches for e in epochs)
    return {
        "samples_per_s": statistics.median(e.samples_per_s for e in epochs),
        "samples_per_s_all": [round(e.samples_per_s, 2) for e in epochs],
        "s_per_batch": total_wall / batches if batches else None,
        # time inside the consumer (the simulated or real training step), per batch
        "step_s_per_batch": sum(e.step_s for e in epochs) / batches if batches else None,
        "first_batch_s": warmup.first_batch_s,
        "first_batch_warm_s": statistics.median(e.first_batch_s for e in epochs),
        "cpu_s_per_1000": 1000 * sum(e.cpu_s for e in epochs) / total_samples,
        "wait_share": sum(e.wait_s for e in epochs) / total_wall,
        "wait_share_steady": steady_wait / steady_wall if steady_wall > 0 else None,
        "epochs_measured": len(epochs),
        "samples_per_epoch": epochs[0].samples,
        "warmup_wall_s": warmup.wall_s,
    }


def timed_epoch(loader, epoch: int, consume) -> EpochStats:
    """Iterate one epoch, timing each wait for a batch separately from the consumer's work."""
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(epoch)
    cpu0 = tree_cpu_seconds()
    start = time.perf_counter()
    iterator = iter(loader)
    waits: list[float] = []
    samples = batches = 0
    step = 0.0
    first = None
    while True:
        t0 = time.perf_counter()
        try:
            batch = next(iterator)
        except StopIteration:
            waits.append(time.perf_counter() - t0)
            break
        t1 = time.perf_counter()
        waits.append(t1 - t0)
        if first is None:
            first = t1 - start
        samples += consume(batch)
        batches += 1
        step += time.perf_counter() - t1
    wall = time.perf_counter() - start
    return EpochStats(
        samples=samples, batches=batches, wall_s=wall, wait_s=sum(waits),
        first_batch_s=first if first is not None else wall, cpu_s=tree_cpu_seconds() - cpu0,
        step_s=step, batch_wait_s=waits,
    )
