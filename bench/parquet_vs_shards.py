"""The same images as tar shards and as Parquet, read by the loader: img/s of each, and the ratio.

    python -m bench.parquet_vs_shards [--quick] [--epochs 4] [--group 256] [--s3]

Both sets are written from the ImageNet-like JPEG folder (``bench/harness/dataset.py``): tar shards of
``--group`` samples (``write_shards``) and one Parquet file of ``--group``-row row groups
(``write_parquet``), so a shard and a row group hold the same images and each is one ranged
read. Each format gets a warm-up epoch, then the measured epochs alternate (tar, Parquet, tar,
...), so a drift of the machine's load touches both alike; the median epoch of each is printed,
with parquet/tar (the target: at least 0.9). ``--s3`` repeats it with both sets in SeaweedFS
(``tests/support/s3server.py``), a real S3 server on the same cores, read through the loader's client.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from asyncload import AsyncLoader, ImageDecoder, image_folder, parquet, tar_shards, write_parquet, write_shards
from bench.harness.dataset import ensure_image_set
from bench.harness.machine import cpu_model
from bench.harness.workloads import image_set
from tests.support.s3server import S3_ENV, SeaweedFS, storage_options


def epoch_rate(source: Any, batch_size: int, epoch: int, options: dict | None) -> float:
    """Images/s of one shuffled epoch (the loader built and its first batch waited for inside)."""
    with AsyncLoader(source, batch_size=batch_size, seed=0, decode=ImageDecoder(224), storage_options=options) as loader:
        loader.set_epoch(epoch)
        started = time.perf_counter()
        count = sum(len(labels) for _, labels in loader)
        return count / (time.perf_counter() - started)


def compare(name: str, sources: dict[str, Any], batch_size: int, epochs: int, options: dict | None) -> None:
    """Warm-up epochs, then ``epochs`` alternating measured epochs per format; prints the medians."""
    for source in sources.values():
        epoch_rate(source, batch_size, 0, options)
    rates: dict[str, list[float]] = {kind: [] for kind in sources}
    for epoch in range(1, epochs + 1):
        for kind, source in sources.items():
            rates[kind].append(epoch_rate(source, batch_size, epoch, options))
    medians = {kind: statistics.median(values) for kind, values in rates.items()}
    for kind, values in rates.items():
        print(f"  {name:5s} {kind:7s}: {medians[kind]:7.0f} img/s (epochs: {', '.join(f'{v:.0f}' for v in values)})")
    print(f"  {name:5s} parquet/tar: {medians['parquet'] / medians['tar']:.2f}", flush=True)


def upload(endpoint_url: str, folder: Path, prefix: str) -> None:
    """Copies ``folder``'s files to ``s3://asyncload-bench/<prefix>/``, then closes the client's
    connections (left open, aiobotocore closes them at exit on a loop that is gone, noisily)."""
    import fsspec.asyn
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **storage_options(endpoint_url))
    try:
        if not fs.exists("asyncload-bench"):
            fs.mkdir("asyncload-bench")
        fs.put(str(folder) + "/", f"asyncload-bench/{prefix}/", recursive=True)
    finally:
        session = fsspec.asyn.sync(fs.loop, fs.set_session)
        fsspec.asyn.sync(fs.loop, session.close)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the 512-image set")
    parser.add_argument("--epochs", type=int, default=4, help="measured epochs per format")
    parser.add_argument("--group", type=int, default=256, help="samples per tar shard = rows per row group")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--s3", action="store_true", help="also from SeaweedFS")
    args = parser.parse_args()
    spec = image_set(args.quick)
    root = ensure_image_set(spec)
    print(f"machine: {cpu_model()}, {len(os.sched_getaffinity(0))} usable cores, load average {os.getloadavg()[0]:.1f}")
    print(f"{spec.count} JPEGs ({spec.name}), {args.group} per shard / row group, batch {args.batch_size}, "
          f"224x224 eval decode, median of {args.epochs} alternating epochs after a warm-up")
    with tempfile.TemporaryDirectory() as folder:
        items = image_folder(str(root))
        shards = Path(folder, "shards")
        tables = Path(folder, "parquet")
        write_shards(items, str(shards), samples_per_shard=args.group)
        write_parquet(items, str(tables / "train.parquet"), rows_per_group=args.group)
        compare("local", {"tar": tar_shards(str(shards)), "parquet": parquet(str(tables))}, args.batch_size,
                args.epochs, None)
        if args.s3:
            os.environ.update(S3_ENV)
            with SeaweedFS() as server:
                options = storage_options(server.endpoint_url)
                upload(server.endpoint_url, shards, "shards")
                upload(server.endpoint_url, tables, "parquet")
                sources = {"tar": tar_shards("s3://asyncload-bench/shards", storage_options=options),
                           "parquet": parquet("s3://asyncload-bench/parquet/", storage_options=options)}
                compare("s3", sources, args.batch_size, args.epochs, options)


if __name__ == "__main__":
    main()
