"""What one read costs in CPU: a GET from the real S3 server (SeaweedFS) against a read of the same
bytes from each disk cache, without decoding (the epochs' figures, decode included, are
``bench.cache_epochs``), rounds interleaved.

    python -m bench.cache_reads [--rounds 3] [--count 1024]

Per round, in one event loop with the reader ``AsyncLoader`` uses (64 reads at once):
- items: every JPEG by one GET each; then a fresh item cache's cold epoch (``ItemCache.read``:
  the GET, and the write of the batch it joins); then its warm epoch as the pipeline reads it (a
  ``CopyRead`` per item, read on this thread as a decode thread would);
- shards: every 16 MB range of the tar shards by one ranged GET each; then the shard cache's warm
  read of the same ranges (``ShardCache.read_copy``; its cold epoch is done once, before round 0).
It prints CPU microseconds per object (items) and milliseconds per MB (shards) of this process
(its threads included; the S3 server is not counted), and the ratios cache / GET.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import tempfile
from typing import Any, Awaitable

from asyncload import image_folder, tar_shards
from asyncload.cache.shards import ShardCache
from asyncload.cache.items import ItemCache
from asyncload.io.reader import Reader
from asyncload.stats.loader_stats import LoaderStats
from bench.harness.dataset import ImageSetSpec, ensure_image_set
from bench.harness.machine import cpu_model
from bench.harness.s3data import S3_POOL, upload, upload_shards
from bench.harness.tasks import s3_options
from bench.harness.workloads import S3_BUCKET
from tests.support.s3server import S3_ENV, SeaweedFS

CHUNK = 16 << 20  # tar_shards' default chunk_bytes
IN_FLIGHT = 64


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _all(reads: list[Awaitable[Any]]) -> float:
    """CPU seconds to run ``reads``, ``IN_FLIGHT`` at a time."""
    gate = asyncio.Semaphore(IN_FLIGHT)

    async def one(read: Awaitable[Any]) -> Any:
        async with gate:
            return await read

    started = _cpu()
    await asyncio.gather(*(one(read) for read in reads))
    return _cpu() - started


async def measure(options: dict, items: Any, shards: Any, rounds: int) -> dict[str, list[float]]:
    reader = Reader(asyncio.get_running_loop(), storage_options=options, timeout=60.0, retries=2,
                    io_concurrency=IN_FLIGHT, stats=LoaderStats())
    urls = [items.url(index) for index in range(len(items))]
    ranges = [(url, start, min(start + CHUNK, size), size)
              for url, size in zip(shards.urls, (int(size) for size in shards.shard_bytes))
              for start in range(0, size, CHUNK)]
    megabytes = sum(end - start for _, start, end, _ in ranges) / 1e6
    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="asyncload-bench-reads-") as folder:
        shard_cache = ShardCache(os.path.join(folder, "shards"), None, reader.read_range, CHUNK, reader.run_blocking,
                                 reader.version, timeout=60.0)
        await _all([shard_cache.read_copy(*chunk) for chunk in ranges])  # cold, once
        try:
            for number in range(rounds):
                get = await _all([reader.read(url) for url in urls])
                cache = ItemCache(os.path.join(folder, f"items-{number}"), None, reader, items.listed)
                cold = await _all([cache.read(url, index) for index, url in enumerate(urls)])
                started = _cpu()
                for index, url in enumerate(urls):
                    hit = cache.hit(url, index)
                    assert hit is not None, url
                    hit.read()
                warm = _cpu() - started
                await cache.aclose()
                ranged = await _all([reader.read_range(url, start, end) for url, start, end, _ in ranges])
                kept = await _all([shard_cache.read_copy(*chunk) for chunk in ranges])
                count = len(urls)
                print(f"round {number}: items: GET {1e6 * get / count:5.0f} us/object, item cache cold "
                      f"{1e6 * cold / count:5.0f}, warm {1e6 * warm / count:4.0f}; shards: ranged GET "
                      f"{1e3 * ranged / megabytes:.2f} ms/MB, shard cache warm {1e3 * kept / megabytes:.2f} ms/MB; "
                      f"load {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
                for name, value in (("items: cache cold / GET", cold / get), ("items: cache warm / GET", warm / get),
                                    ("shards: cache warm / ranged GET", kept / ranged)):
                    results.setdefault(name, []).append(value)
        finally:
            await shard_cache.aclose()
            await reader.aclose()
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--count", type=int, default=1024, help="JPEGs (ImageNet-like, 500x375)")
    args = parser.parse_args(argv)
    print(f"machine: {cpu_model()}, {len(os.sched_getaffinity(0))} usable cores, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    spec = ImageSetSpec(f"imagenet-like-{args.count}", count=args.count, classes=64)
    ensure_image_set(spec)
    shards_name = f"{spec.name}-shards256"
    os.environ.update(S3_ENV)
    with SeaweedFS() as server:
        upload(server.endpoint_url, spec.name)
        upload_shards(server.endpoint_url, shards_name, spec.name, 256)
        options = s3_options(server.endpoint_url, S3_POOL)
        items = image_folder(f"s3://{S3_BUCKET}/{spec.name}", storage_options=options, cache_dir="unused")
        shards = tar_shards(f"s3://{S3_BUCKET}/{shards_name}", storage_options=options)
        ratios = asyncio.run(measure(options, items, shards, args.rounds))
    for name, values in ratios.items():
        print(f"CPU {name}: {', '.join(f'{v:.2f}' for v in values)} (median {statistics.median(values):.2f})")


if __name__ == "__main__":
    main()
