"""What asyncload's always-on stats cost: per event, per sample, and end to end.

    python -m bench.stats_overhead [--epochs 6]

1. The cost of one stats event (a counter or level update: a clock read and a lock), timed
   over many calls.
2. Those events per sample (counted on a real epoch) times that cost, against the CPU time a
   sample takes in the same epoch: the overhead as a share of the work.
3. End to end: epochs of the ImageNet-like workload with the real stats and with a do-nothing
   stand-in, alternated, median samples/s of each (noisy on a shared machine; 1 and 2 are not).
"""

from __future__ import annotations

import argparse
import statistics
import time

from asyncload import AsyncLoader
from asyncload.stats.loader_stats import LoaderStats
from bench.harness import tasks
from bench.harness.dataset import ensure_image_set
from bench.harness.workloads import image_set


class CountingStats(LoaderStats):
    """Real stats that also count the events they record."""

    events = 0

    def add(self, *args, **kwargs):
        CountingStats.events += 1
        super().add(*args, **kwargs)

    def level(self, *args, **kwargs):
        CountingStats.events += 1
        super().level(*args, **kwargs)


class NoStats(LoaderStats):
    """Records nothing: the baseline."""

    def add(self, *args, **kwargs):
        pass

    def level(self, *args, **kwargs):
        pass


def event_cost(calls: int = 200_000) -> float:
    stats = LoaderStats()
    started = time.perf_counter()
    for _ in range(calls // 2):
        stats.level("decodes_running", 1)
        stats.add("decode", 0.001)
    return (time.perf_counter() - started) / calls


def epoch(source, stats_class) -> tuple[float, float]:
    """samples/s and process CPU seconds per sample for one epoch with ``stats_class``."""
    loader = AsyncLoader(source, batch_size=128, decode=tasks.image_decoder())
    loader.stats = loader._backend.pipelines.stats = stats_class(64, loader._settings.num_threads, 2)
    with loader:
        list(loader)  # warm the page cache and the ring
        started, cpu = time.perf_counter(), time.process_time()
        samples = sum(len(labels) for _, labels in loader)
        return samples / (time.perf_counter() - started), (time.process_time() - cpu) / samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=6)
    args = parser.parse_args()
    from asyncload import image_folder

    source = image_folder(str(ensure_image_set(image_set(quick=True))))
    cost = event_cost()
    CountingStats.events = 0
    _, cpu_per_sample = epoch(source, CountingStats)
    per_sample = CountingStats.events / (2 * len(source))  # the warm-up epoch and the measured one
    print(f"one stats event: {cost * 1e6:.2f} us; {per_sample:.1f} events per sample; "
          f"a sample costs {cpu_per_sample * 1e3:.2f} ms of CPU")
    print(f"stats overhead: {100 * per_sample * cost / cpu_per_sample:.2f} % of the CPU work per sample")
    rates: dict[str, list[float]] = {"stats": [], "no stats": []}
    for _ in range(args.epochs):
        rates["stats"].append(epoch(source, LoaderStats)[0])
        rates["no stats"].append(epoch(source, NoStats)[0])
    with_stats, without = statistics.median(rates["stats"]), statistics.median(rates["no stats"])
    print(f"end to end, median of {args.epochs}: {with_stats:.0f} samples/s with stats, {without:.0f} without "
          f"({100 * (without - with_stats) / without:+.1f} %)")


if __name__ == "__main__":
    main()
