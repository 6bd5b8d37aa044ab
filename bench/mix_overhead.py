"""What mixing costs: the same images as one source, or split in two halves mixed 50/50.

    python -m bench.mix_overhead [--epochs 8] [--full]

Both loaders read and decode the same JPEGs (the ImageNet-like set; ``stop="all"``, so the mix
delivers every image once, as the plain source does); epochs alternate between them on loaders
kept open, and the median images/s of each is compared. Also timed apart: the mix's per-sample
cost on the hot path (``split``: which source, which item) and its per-epoch sequence.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from asyncload import AsyncLoader, Source, image_folder, mix
from asyncload.pipeline.jobs import split
from bench.harness import tasks
from bench.harness.dataset import ensure_image_set
from bench.harness.workloads import image_set


def halves(source: Source) -> dict[str, Source]:
    """The source's items in two sources: even and odd positions (both see every class)."""
    items = [source[i] for i in range(len(source))]
    return {name: Source([u for u, _ in part], [l for _, l in part], source.classes)
            for name, part in (("even", items[0::2]), ("odd", items[1::2]))}


def epoch_rate(loader: AsyncLoader) -> float:
    """Images/s of one pass."""
    started = time.perf_counter()
    samples = sum(len(batch[1]) for batch in loader)
    return samples / (time.perf_counter() - started)


def split_cost(source, calls: int = 200_000) -> float:
    """Seconds per ``split`` of an item: the per-sample Python the mix adds on the hot path."""
    started = time.perf_counter()
    for index in range(calls):
        split(source, True, index % len(source))
    return (time.perf_counter() - started) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--full", action="store_true", help="the 2048-image set (default: 512)")
    args = parser.parse_args()
    plain = image_folder(str(ensure_image_set(image_set(quick=not args.full))))
    mixed = mix(halves(plain), {"even": 1, "odd": 1}, stop="all")
    print(f"{len(plain)} images; load average {os.getloadavg()[0]:.2f} at start")
    print(f"split per sample: plain {split_cost(plain) * 1e6:.2f} us, mixed {split_cost(mixed) * 1e6:.2f} us")
    started = time.perf_counter()
    for epoch in range(20):
        mixed.sequence(epoch)
    print(f"mixed sequence: {(time.perf_counter() - started) / 20 * 1e3:.2f} ms per epoch of {len(mixed)}")
    rates: dict[str, list[float]] = {"plain": [], "mixed": []}
    kwargs = dict(batch_size=128, decode=tasks.image_decoder())
    with AsyncLoader(plain, **kwargs) as one, AsyncLoader(mixed, **kwargs) as two:
        epoch_rate(one), epoch_rate(two)  # warm the page cache and the rings
        for _ in range(args.epochs):
            rates["plain"].append(epoch_rate(one))
            rates["mixed"].append(epoch_rate(two))
        print(f"per-source counts: {two.stats.sources}")
    plain_rate, mixed_rate = statistics.median(rates["plain"]), statistics.median(rates["mixed"])
    print(f"median of {args.epochs} alternating epochs: plain {plain_rate:.0f} img/s, mixed 50/50 {mixed_rate:.0f} img/s, "
          f"mixed/plain {mixed_rate / plain_rate:.3f} ({100 * (plain_rate - mixed_rate) / plain_rate:+.1f} % cost); "
          f"load average {os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()
