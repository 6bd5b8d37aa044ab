"""What the disk cache (``cache_dir``) costs on the cold epoch and gains on the warm one, for tar
shards and for ``image_folder``, on the real S3 server (SeaweedFS), rounds interleaved, against
reading the bucket without a cache and against litdata's own cached epoch.

    python -m bench.cache_epochs [--rounds 3] [--count 4096] [--batch-size 64] [--processes 0]
                                 [--only shards|items|litdata] [--workers 2] [--decode jpeg|none]

Each round runs, one after the other in this process: tar shards without a cache (two epochs),
tar shards with a fresh ``cache_dir`` (cold epoch, warm epoch), the same for ``image_folder`` on
the bucket, then litdata (its ``optimize()`` output, ``{"image": JPEG bytes, "label": int}``, read
by its own ``StreamingDataset`` with a fresh ``cache_dir`` in a ``DataLoader`` of ``--workers``
workers: its cold epoch downloads the chunks, its warm one reads its cache). Every epoch decodes
the same JPEGs with the same transforms (``ImageDecoder``, random-resized-crop 224 + flip; with
``--decode none``, no decode at all: the CPU per image is then what the reads cost). It
prints each epoch's images/s, CPU per image (this process and its finished children: the S3
server is not counted), the bytes and requests it read from the bucket, the load average, and per
round the ratios: the cached cold epoch over the uncached one, the cached warm epoch over the
uncached warm one (the bucket) and over litdata's cached epoch, in images/s and in CPU per image.
On a shared box the absolute rates drift by a lot within minutes; the ratios within one round
share that drift, so quote their median.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
import resource
import statistics
import tempfile
import time
from typing import Any

import numpy as np

from asyncload import AsyncLoader, ImageDecoder, image_folder, tar_shards
from bench.harness.dataset import DATA_ROOT, ImageSetSpec, ensure_image_set, list_image_folder
from bench.harness.machine import cpu_model
from bench.harness.s3data import S3_POOL, upload, upload_shards
from bench.harness.tasks import s3_options
from bench.harness.workloads import S3_BUCKET
from tests.support.s3server import S3_ENV, SeaweedFS

SAMPLES_PER_SHARD = 256


def _litdata_sample(item: tuple[str, int]) -> dict[str, Any]:
    return {"image": Path(item[0]).read_bytes(), "label": int(item[1])}


def ensure_litdata(dataset: str, name: str) -> Path:
    """litdata's ``optimize()`` output of ``dataset`` (bytes and int leaves: its Arrow layout), in
    bench/data/<name>/ (written once, kept like the images)."""
    from litdata import optimize

    root = DATA_ROOT / name
    if not (root / "index.json").exists():
        items, _ = list_image_folder(DATA_ROOT / dataset)
        optimize(fn=_litdata_sample, inputs=[(str(path), int(label)) for path, label in items],
                 output_dir=str(root), chunk_size=SAMPLES_PER_SHARD, num_workers=1)
    return root


def byte_count(data: Any) -> np.ndarray:
    """``--decode none``'s decoder: the sample's size, so that an epoch costs its reads alone."""
    return np.array([len(data)], dtype=np.int64)


def decoder(kind: str) -> Any:
    return ImageDecoder(size=224, train=True, seed=0) if kind == "jpeg" else byte_count


class DecodeBatch:
    """``collate_fn`` for litdata's ``DataLoader``: the same ``ImageDecoder`` as asyncload's
    epochs, run in the workers (a class: the workers must pickle it)."""

    def __init__(self, kind: str = "jpeg") -> None:
        self.decode = decoder(kind)

    def __call__(self, samples: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
        if self.decode is byte_count:
            return np.array([len(sample["image"]) for sample in samples]), np.array([s["label"] for s in samples])
        images = np.empty((len(samples), *self.decode.field.shape), dtype=np.uint8)
        for row, sample in enumerate(samples):
            self.decode.decode_into(sample["image"], images[row], (0, row))
        return images, np.array([sample["label"] for sample in samples])


def allow_http(worker: int = 0) -> None:
    """Lets litdata's obstore client reach the local server's ``http://`` endpoint (its client
    options do not say ``allow_http``; a real bucket is https). Run in each worker."""
    from litdata.streaming import downloader

    downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = True


def litdata_epochs(url: str, endpoint_url: str, cache_dir: str, batch_size: int, workers: int,
                   count: int, decode: str = "jpeg") -> list[dict[str, float]]:
    """Two epochs of litdata's ``StreamingDataset`` (shuffled, its cache in ``cache_dir``) in a
    ``DataLoader``: images/s and CPU per image, per epoch."""
    from litdata import StreamingDataset
    from torch.utils.data import DataLoader

    dataset = StreamingDataset(url, cache_dir=cache_dir, shuffle=True, seed=0, max_cache_size="50GB",
                               storage_options={"endpoint_url": endpoint_url,
                                                "aws_access_key_id": S3_ENV["AWS_ACCESS_KEY_ID"],
                                                "aws_secret_access_key": S3_ENV["AWS_SECRET_ACCESS_KEY"]})
    allow_http()
    # spawned workers: this process's own obstore runtime (asyncload's reads) must not be forked
    # persistent workers: the warm epoch pays no start; their CPU is read while they live (psutil)
    loader = DataLoader(dataset, batch_size=batch_size, num_workers=workers, collate_fn=DecodeBatch(decode),
                        worker_init_fn=allow_http, multiprocessing_context="spawn" if workers else None,
                        persistent_workers=workers > 0)
    rows = []
    for epoch in range(2):
        dataset.set_epoch(epoch)
        started, seen = time.perf_counter(), 0
        cpu = _tree_cpu()
        for _, labels in loader:
            seen += len(labels)
        elapsed = time.perf_counter() - started
        rows.append({"rate": seen / elapsed, "cpu_ms": 1000 * (_tree_cpu() - cpu) / max(seen, 1), "bytes": 0,
                     "requests": 0, "samples": seen})
    del loader
    assert all(row["samples"] == count for row in rows), rows
    return rows


def _tree_cpu() -> float:
    """CPU seconds of this process and its living spawned children (persistent workers), plus
    finished ones; a worker started since the last call counts from its start."""
    import psutil

    me = psutil.Process()
    total = _cpu()
    for child in me.children(recursive=True):
        try:
            if "multiprocessing" not in " ".join(child.cmdline()):
                continue  # the S3 server: not the loader's CPU
            times = child.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def epochs(source: Any, options: dict, batch_size: int, processes: int, count: int,
           decode_kind: str = "jpeg") -> list[dict[str, float]]:
    """Two epochs of one loader: images/s, and bytes and requests read from storage, per epoch."""
    decode = decoder(decode_kind)
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
    parser.add_argument("--only", choices=("shards", "items", "litdata"), default=None)
    parser.add_argument("--decode", choices=("jpeg", "none"), default="jpeg",
                        help="none: each sample's size only, so that the CPU per image is the reads'")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                        help="litdata's DataLoader workers (default: the usable cores)")
    args = parser.parse_args(argv)
    print(f"machine: {cpu_model()}, {len(os.sched_getaffinity(0))} usable cores, load average {_load()}", flush=True)
    spec = ImageSetSpec(f"imagenet-like-{args.count}", count=args.count, classes=64)
    ensure_image_set(spec)
    shards_name = f"{spec.name}-shards{SAMPLES_PER_SHARD}"
    litdata_name = f"{spec.name}-litdata{SAMPLES_PER_SHARD}"
    os.environ.update(S3_ENV)
    with SeaweedFS() as server:
        upload(server.endpoint_url, spec.name)
        upload_shards(server.endpoint_url, shards_name, spec.name, SAMPLES_PER_SHARD)
        options = s3_options(server.endpoint_url, S3_POOL)
        kinds = {"shards": lambda cache: tar_shards(f"s3://{S3_BUCKET}/{shards_name}", storage_options=options,
                                                    cache_dir=cache),
                 "items": lambda cache: image_folder(f"s3://{S3_BUCKET}/{spec.name}", storage_options=options,
                                                     cache_dir=cache)}
        chosen = [args.only] if args.only else [*kinds, "litdata"]
        if "litdata" in chosen:
            import s3fs

            local = ensure_litdata(spec.name, litdata_name)
            s3fs.S3FileSystem(**options).put(str(local), f"{S3_BUCKET}/{litdata_name}", recursive=True)
        ratios: dict[str, list[float]] = {}
        cached_warm: dict[str, dict[str, float]] = {}
        for number in range(args.rounds):
            for kind in chosen:
                if kind == "litdata":
                    with tempfile.TemporaryDirectory(prefix="asyncload-bench-litdata-") as folder:
                        rows = litdata_epochs(f"s3://{S3_BUCKET}/{litdata_name}", server.endpoint_url, folder,
                                              args.batch_size, args.workers, args.count, args.decode)
                    for which, row in zip(("cold", "warm"), rows):
                        print(f"round {number} litdata cache_dir {which}: {row['rate']:7.0f} img/s, "
                              f"{row['cpu_ms']:5.2f} CPU ms/img, {args.workers} workers, load {_load()}", flush=True)
                    for other, warm in cached_warm.items():
                        ratios.setdefault(f"{other}: cache warm / litdata cached (warm) epoch", []).append(
                            warm["rate"] / rows[1]["rate"])
                        ratios.setdefault(f"{other}: CPU/img cache warm / litdata cached (warm) epoch", []).append(
                            warm["cpu_ms"] / rows[1]["cpu_ms"])
                    cached_warm = {}
                    continue
                plain = epochs(kinds[kind](None), options, args.batch_size, args.processes, args.count, args.decode)
                with tempfile.TemporaryDirectory(prefix="asyncload-bench-cache-") as folder:
                    cached = epochs(kinds[kind](folder), options, args.batch_size, args.processes, args.count,
                                    args.decode)
                for name, rows in (("no cache", plain), ("cache_dir", cached)):
                    for which, row in zip(("cold", "warm"), rows):
                        print(f"round {number} {kind:6s} {name:9s} {which}: {row['rate']:7.0f} img/s, "
                              f"{row['cpu_ms']:5.2f} CPU ms/img, "
                              f"{row['bytes'] / 1e6:7.1f} MB, {row['requests']:5d} requests, load {_load()}", flush=True)
                cached_warm[kind] = cached[1]
                ratios.setdefault(f"{kind}: cache cold / no cache cold", []).append(cached[0]["rate"] / plain[0]["rate"])
                ratios.setdefault(f"{kind}: cache warm / cache cold", []).append(cached[1]["rate"] / cached[0]["rate"])
                ratios.setdefault(f"{kind}: cache warm / no cache warm", []).append(cached[1]["rate"] / plain[1]["rate"])
                ratios.setdefault(f"{kind}: cache warm / no cache (mean of both epochs)", []).append(
                    cached[1]["rate"] / statistics.mean(row["rate"] for row in plain))
                ratios.setdefault(f"{kind}: CPU/img cache cold / no cache cold", []).append(
                    cached[0]["cpu_ms"] / plain[0]["cpu_ms"])
                ratios.setdefault(f"{kind}: CPU/img cache warm / no cache warm", []).append(
                    cached[1]["cpu_ms"] / plain[1]["cpu_ms"])
        for name, values in ratios.items():
            print(f"{name}: {', '.join(f'{v:.2f}' for v in values)} (median {statistics.median(values):.2f})")
    print(f"load average at the end {_load()}")


if __name__ == "__main__":
    main()
