"""What the disk cache (``cache_dir``) costs on the cold epoch and gains on the warm one, for tar
shards and for ``image_folder``, on the real S3 server (SeaweedFS), rounds interleaved.

    python -m bench.cache_epochs [--rounds 3] [--count 4096] [--batch-size 64] [--processes 0]

Each round runs, one after the other in this process: tar shards without a cache (two epochs),
tar shards with a fresh ``cache_dir`` (cold epoch, warm epoch), then the same for
``image_folder`` on the bucket. Every epoch decodes the same JPEGs with the same transforms
(``ImageDecoder``, random-resized-crop 224 + flip). It prints each epoch's images/s, the bytes
and requests it read from the bucket, and per round the ratios that matter: the cached cold epoch
over the uncached one (the cache should cost nothing: >= 0.97) and, for ``image_folder``, the
cached warm epoch over its cold one (>= 1.3). On a shared box the absolute rates drift by a lot
within minutes; the ratios within one round share that drift, so quote their median.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import tempfile
import time
from typing import Any

from asyncload import AsyncLoader, ImageDecoder, image_folder, tar_shards
from bench.harness.dataset import ImageSetSpec, ensure_image_set
from bench.harness.machine import cpu_model
from bench.harness.s3data import S3_POOL, upload, upload_shards
from bench.harness.tasks import s3_options
from bench.harness.workloads import S3_BUCKET
from tests.support.s3server import S3_ENV, SeaweedFS

SAMPLES_PER_SHARD = 256


def epochs(source: Any, options: dict, batch_size: int, processes: int, count: int) -> list[dict[str, float]]:
    """Two epochs of one loader: images/s, and bytes and requests read from storage, per epoch."""
    decode = ImageDecoder(size=224, train=True, seed=0)
    rows = []
    with AsyncLoader(source, batch_size=batch_size, decode=decode, seed=0, processes=processes,
                     storage_options=options) as loader:
        before = loader.stats.as_dict()
        for _ in range(2):
            started, cpu, seen = time.perf_counter(), _cpu(), 0
            for _, labels in loader:
                seen += len(labels)
            elapsed = time.perf_counter() - started
            after = loader.stats.as_dict()
            rows.append({"rate": seen / elapsed, "cpu_ms": 1000 * (_cpu() - cpu) / max(seen, 1),
                         "bytes": after["read/bytes"] - before["read/bytes"],
                         "requests": after["read/items"] - before["read/items"], "samples": seen})
            before = after
    assert all(row["samples"] == count for row in rows), rows
    return rows


def _cpu() -> float:
    """CPU seconds of this process and its finished children (processes=N): less moved by a busy
    box than wall time (SeaweedFS is not counted)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--count", type=int, default=4096, help="JPEGs (ImageNet-like, 500x375)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--processes", type=int, default=0)
    parser.add_argument("--only", choices=("shards", "items"), default=None)
    args = parser.parse_args(argv)
    print(f"machine: {cpu_model()}, {len(os.sched_getaffinity(0))} usable cores, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    spec = ImageSetSpec(f"imagenet-like-{args.count}", count=args.count, classes=64)
    ensure_image_set(spec)
    shards_name = f"{spec.name}-shards{SAMPLES_PER_SHARD}"
    os.environ.update(S3_ENV)
    with SeaweedFS() as server:
        upload(server.endpoint_url, spec.name)
        upload_shards(server.endpoint_url, shards_name, spec.name, SAMPLES_PER_SHARD)
        options = s3_options(server.endpoint_url, S3_POOL)
        kinds = {"shards": lambda cache: tar_shards(f"s3://{S3_BUCKET}/{shards_name}", storage_options=options,
                                                    cache_dir=cache),
                 "items": lambda cache: image_folder(f"s3://{S3_BUCKET}/{spec.name}", storage_options=options,
                                                     cache_dir=cache)}
        chosen = [args.only] if args.only else list(kinds)
        ratios: dict[str, list[float]] = {}
        for number in range(args.rounds):
            for kind in chosen:
                plain = epochs(kinds[kind](None), options, args.batch_size, args.processes, args.count)
                with tempfile.TemporaryDirectory(prefix="asyncload-bench-cache-") as folder:
                    cached = epochs(kinds[kind](folder), options, args.batch_size, args.processes, args.count)
                for name, rows in (("no cache", plain), ("cache_dir", cached)):
                    for which, row in zip(("cold", "warm"), rows):
                        print(f"round {number} {kind:6s} {name:9s} {which}: {row['rate']:7.0f} img/s, "
                              f"{row['cpu_ms']:5.2f} CPU ms/img, "
                              f"{row['bytes'] / 1e6:7.1f} MB, {row['requests']:5d} requests", flush=True)
                ratios.setdefault(f"{kind}: cache cold / no cache cold", []).append(cached[0]["rate"] / plain[0]["rate"])
                ratios.setdefault(f"{kind}: cache warm / cache cold", []).append(cached[1]["rate"] / cached[0]["rate"])
                ratios.setdefault(f"{kind}: cache warm / no cache warm", []).append(cached[1]["rate"] / plain[1]["rate"])
                ratios.setdefault(f"{kind}: CPU/img cache cold / no cache cold", []).append(
                    cached[0]["cpu_ms"] / plain[0]["cpu_ms"])
        for name, values in ratios.items():
            print(f"{name}: {', '.join(f'{v:.2f}' for v in values)} (median {statistics.median(values):.2f})")
    print(f"load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
