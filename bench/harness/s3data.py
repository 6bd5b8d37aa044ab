"""Putting the image sets into the local S3 server (SeaweedFS), and the servers' lifetime for a
bench run."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

from bench.harness.dataset import DATA_ROOT, list_image_folder
from bench.harness.tasks import s3_options
from bench.harness.workloads import S3_BUCKET, S3_LATENCY
from tests.support.s3server import S3_ENV, LatencyProxy, SeaweedFS

# Threaded readers must not be capped by botocore's 10 pooled connections (asyncload raises its
# own pool to io_concurrency; DataLoader workers read one object at a time each).
S3_POOL = 64


def upload(endpoint_url: str, dataset: str) -> int:
    """Copies bench/data/<dataset>/ to s3://asyncload-bench/<dataset>/; returns objects put."""
    root = DATA_ROOT / dataset
    items, _ = list_image_folder(root)
    return _put(endpoint_url, dataset, root, [Path(p) for p, _ in items])


def upload_shards(endpoint_url: str, name: str, dataset: str, samples_per_shard: int) -> int:
    """Writes bench/data/<dataset>/ as tar shards in bench/data/<name>/ (once; cached like the
    images) and copies them to s3://asyncload-bench/<name>/; returns objects put."""
    from asyncload import image_folder, write_shards

    root = DATA_ROOT / name
    if not (root / "index.json").exists():
        write_shards(image_folder(str(DATA_ROOT / dataset)), str(root), samples_per_shard=samples_per_shard)
    return _put(endpoint_url, name, root, sorted(root.iterdir()))


def _put(endpoint_url: str, prefix: str, root: Path, paths: list[Path]) -> int:
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_options(endpoint_url, S3_POOL))
    if not fs.exists(S3_BUCKET):
        fs.mkdir(S3_BUCKET)
    objects = {f"{S3_BUCKET}/{prefix}/{p.relative_to(root).as_posix()}": p.read_bytes() for p in paths}
    fs.pipe(objects, batch_size=32)
    return len(objects)


@contextlib.contextmanager
def s3_servers(datasets: set[str], shard_sets: dict[str, tuple[str, int]], latency: bool) -> Iterator[dict[str, dict]]:
    """Starts SeaweedFS (and the latency proxy in front of it), uploads the image sets and the shard
    sets (name -> (image set, samples per shard)), and yields the
    storage options per S3 source kind: {"s3": ..., "s3-latency": ...}, and under "pids" the
    servers' process ids (their CPU time is reported separately). Stops both on exit."""
    os.environ.update(S3_ENV)
    with SeaweedFS() as server:
        for dataset in sorted(datasets):
            upload(server.endpoint_url, dataset)
        for name, (dataset, samples_per_shard) in sorted(shard_sets.items()):
            upload_shards(server.endpoint_url, name, dataset, samples_per_shard)
        options: dict = {"s3": s3_options(server.endpoint_url, S3_POOL), "pids": [server.pid]}
        if not latency:
            yield options
            return
        with LatencyProxy(server.port, S3_LATENCY) as proxy:
            options["s3-latency"] = s3_options(proxy.endpoint_url, S3_POOL)
            options["pids"].append(proxy.pid)
            yield options
