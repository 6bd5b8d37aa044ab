"""Ranged reads per run of tar shards, in-process and with ``processes=2`` and ``4``.

    python -m bench.shard_reads [--samples 100000] [--batch-size 256] [--shard 1000]

Writes ``--samples`` small members (1 KiB each, named ``.jpg``; the decode only reads their
first bytes) as tar shards in a temporary folder, then runs one shuffled epoch of each loader
and prints the reads the run made (``read/items``: each a ranged read of a shard chunk), the
samples/s, and whether every sample came once. A run plans its chunk reads once, whatever the
number of processes, so the reads should be equal across the rows; before the one pipeline,
``processes=N`` opened a stream per batch and made a read per batch and shard touched.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from asyncload import AsyncLoader, tar_shards, write_shards
from bench.harness.machine import cpu_model

MEMBER_BYTES = 1024


def first_bytes(data: bytes) -> np.ndarray:
    """The decode: the member's first 8 bytes (the loader's work, not a decoder's, is measured)."""
    return np.frombuffer(bytes(data[:8]), np.uint8).copy()


def write_members(folder: Path, count: int) -> list[str]:
    rng = np.random.default_rng(0)
    paths = []
    for index in range(count):
        path = folder / f"{index:07d}.jpg"
        path.write_bytes(rng.bytes(MEMBER_BYTES))
        paths.append(str(path))
    return paths


def run(url: str, processes: int, batch_size: int, count: int) -> tuple[int, float, bool]:
    """One epoch: the run's reads, its samples/s, and whether every sample came exactly once."""
    source = tar_shards(url, shuffle_buffer=batch_size * 4)
    with AsyncLoader(source, batch_size=batch_size, seed=0, decode=first_bytes, processes=processes) as loader:
        started = time.perf_counter()
        seen: list[int] = []
        for _, labels in loader:
            seen.extend(labels.tolist())
        elapsed = time.perf_counter() - started
        reads = int(loader.stats.as_dict()["read/items"])
    return reads, count / elapsed, sorted(seen) == list(range(count))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--shard", type=int, default=1000, help="samples per shard")
    args = parser.parse_args()
    print(f"machine: {cpu_model()}, {len(os.sched_getaffinity(0))} usable cores, "
          f"load average {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory() as folder:
        members = Path(folder, "members")
        members.mkdir()
        items = [(path, index) for index, path in enumerate(write_members(members, args.samples))]
        url = write_shards(items, str(Path(folder, "shards")), samples_per_shard=args.shard)
        shards = -(-args.samples // args.shard)
        print(f"{args.samples} samples of {MEMBER_BYTES} B in {shards} shards, batch {args.batch_size}, shuffled")
        for processes in (0, 2, 4):
            reads, rate, exact = run(url, processes, args.batch_size, args.samples)
            print(f"  processes={processes}: {reads:7d} ranged reads, {rate:8.0f} samples/s, "
                  f"{'every sample once' if exact else 'SAMPLES LOST OR REPEATED'}", flush=True)


if __name__ == "__main__":
    main()
