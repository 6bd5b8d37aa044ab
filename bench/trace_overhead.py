"""What ``trace=`` costs: samples/s with the timeline on against off, in alternating epochs.

    python -m bench.trace_overhead [--rounds 5]

Two workloads, each loader built once and warmed up, then rounds of one epoch with tracing and
one without, in alternating order (so the machine's drift touches both):

- ``images``: the ImageNet-like local JPEGs (decode + random-resized-crop + flip), where decode
  dominates, as in training;
- ``gil``: the one-GIL proxy of ``bench.gil_ceiling`` (small files, a 2 ms decode that holds
  neither the GIL nor a core), where the loader's own Python per sample is all there is, so the
  tracer's cost per event shows at its largest.

Prints each round and the median ratio traced/untraced per workload (1.00: free), and how long
writing the file took at close (not in the epochs: the loader writes it once, when closed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from asyncload import AsyncLoader, image_folder
from bench.harness import tasks
from bench.harness.dataset import ensure_image_set
from bench.gil_ceiling import SleepDecoder, make_files
from bench.harness.machine import cpu_model
from bench.harness.workloads import image_set


def epoch(loader: AsyncLoader) -> float:
    started = time.perf_counter()
    samples = sum(len(batch[-1]) if isinstance(batch, (tuple, list)) else len(batch) for batch in loader)
    return samples / (time.perf_counter() - started)


def compare(name: str, build: Any, rounds: int, folder: Path) -> None:
    loaders = {"traced": build(str(folder / f"{name}.json")), "untraced": build(None)}
    try:
        for loader in loaders.values():
            epoch(loader)  # warm-up: threads, buffers, page cache
        rates: dict[str, list[float]] = {key: [] for key in loaders}
        for number in range(rounds):
            order = list(loaders) if number % 2 == 0 else list(reversed(loaders))
            for key in order:
                rates[key].append(epoch(loaders[key]))
            print(f"  {name} round {number + 1}: traced {rates['traced'][-1]:.0f}/s, "
                  f"untraced {rates['untraced'][-1]:.0f}/s", flush=True)
        ratios = [t / u for t, u in zip(rates["traced"], rates["untraced"])]
        events = len(loaders["traced"].stats.tracer.events)  # type: ignore[union-attr]
        started = time.perf_counter()
        loaders["traced"].close()
        closed = time.perf_counter() - started
        print(f"{name}: traced/untraced median {statistics.median(ratios):.3f} "
              f"(rounds {min(ratios):.3f}-{max(ratios):.3f}); {events} events kept, close() with the write "
              f"{closed:.2f} s", flush=True)
    finally:
        for loader in loaders.values():
            loader.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(f"machine: {cpu_model()}, {len(os.sched_getaffinity(0))} usable cores, "
          f"load average {os.getloadavg()[0]:.1f}")
    images = image_folder(str(ensure_image_set(image_set(quick=False))))
    with tempfile.TemporaryDirectory() as folder:
        compare("images", lambda trace: AsyncLoader(images, batch_size=256, decode=tasks.image_decoder(), trace=trace),
                args.rounds, Path(folder))
        files = make_files(8192)
        compare("gil", lambda trace: AsyncLoader(files, batch_size=256, shuffle=False, decode=SleepDecoder(),
                                                 num_threads=64, trace=trace), args.rounds, Path(folder))


if __name__ == "__main__":
    main()
