"""The same JPEGs as asyncload tar shards, MDS shards, litdata chunks and WebDataset tars (no
index), all read by asyncload from a real S3 server: img/s of each, its ratio to asyncload's own
shards, and the bytes and requests of an epoch.

    python -m bench.formats [--quick] [--epochs 3] [--group 256] [--batch-size 128]

The JPEG folder is ``bench/dataset.py``'s ImageNet-like set; every format holds its files' bytes
unchanged (MDS's ``jpeg`` and litdata's ``jpeg`` keep a JPEG file's bytes), ``--group`` samples
per shard or chunk. The writers are the real ones (MosaicML Streaming's ``MDSWriter``, litdata's
``optimize``, webdataset's ``ShardWriter``). The WebDataset tars are read through a brace
pattern without an ``index.json``: the time of learning their member table (once, before the
first epoch) is printed apart. Each format gets a warm-up epoch, then the measured epochs
alternate between the formats, each round
starting with another; medians are printed. Needs ``streaming``, ``litdata`` and
``webdataset`` installed (the benchmark venv has them).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from asyncload import AsyncLoader, ImageDecoder, image_folder, litdata, mds, tar_shards, write_shards
from bench.harness.dataset import ensure_image_set
from bench.harness.machine import cpu_model
from bench.harness.workloads import image_set
from bench.parquet_vs_shards import upload
from tests.support.s3server import S3_ENV, SeaweedFS, storage_options


def write_mds(items: Any, out: str, group_bytes: int) -> None:
    from PIL import Image

    from tests.fixtures.make_formats import mds_writer

    with mds_writer()(out=out, columns={"image": "jpeg", "label": "int"}, size_limit=group_bytes) as writer:
        for url, label in items:
            writer.write({"image": Image.open(url), "label": int(label)})


def _litdata_sample(item: tuple[str, int]) -> dict[str, Any]:
    from PIL import Image

    return {"image": Image.open(item[0]), "label": int(item[1])}


def write_litdata(items: Any, out: str, group: int) -> None:
    from litdata import optimize

    optimize(fn=_litdata_sample, inputs=[(url, int(label)) for url, label in items], output_dir=out,
             chunk_size=group, num_workers=1)


def write_webdataset(items: Any, out: str, group: int) -> int:
    import webdataset as wds

    os.makedirs(out)
    with wds.ShardWriter(os.path.join(out, "%06d.tar"), maxcount=group, verbose=0) as sink:
        for number, (url, label) in enumerate(items):
            sink.write({"__key__": f"{number:08d}", "jpg": Path(url).read_bytes(), "cls": str(int(label)).encode()})
    return len(os.listdir(out))


def epoch(source: Any, batch_size: int, number: int, options: dict) -> tuple[float, int, int]:
    """img/s, bytes read and requests of one shuffled epoch."""
    decode = None if getattr(source, "default_decode", None) else ImageDecoder(224)
    with AsyncLoader(source, batch_size=batch_size, seed=0, decode=decode, storage_options=options) as loader:
        loader.set_epoch(number)
        started = time.perf_counter()
        count = sum(len(labels) for _, labels in loader)
        rate = count / (time.perf_counter() - started)
        figures = loader.stats.as_dict()
    return rate, int(figures["read/bytes"]), int(figures["read/items"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the 512-image set")
    parser.add_argument("--epochs", type=int, default=3, help="measured epochs per format")
    parser.add_argument("--group", type=int, default=256, help="samples per shard / chunk")
    parser.add_argument("--batch-size", type=int, default=128)
    args = parser.parse_args()
    spec = image_set(args.quick)
    root = ensure_image_set(spec)
    items = image_folder(str(root))
    total = sum(os.path.getsize(url) for url, _ in items)
    print(f"machine: {cpu_model()}, {len(os.sched_getaffinity(0))} usable cores, load average {os.getloadavg()[0]:.1f}")
    print(f"{len(items)} JPEGs ({total / 1e6:.1f} MB), {args.group} per shard, batch {args.batch_size}, 224x224 eval "
          f"decode, SeaweedFS on this machine, median of {args.epochs} alternating epochs after a warm-up", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        paths = {kind: os.path.join(folder, kind) for kind in ("tar", "mds", "litdata", "wds")}
        write_shards(items, paths["tar"], samples_per_shard=args.group)
        write_mds(items, paths["mds"], int(total / len(items) * args.group))
        write_litdata(items, paths["litdata"], args.group)
        shards = write_webdataset(items, paths["wds"], args.group)
        os.environ.update(S3_ENV)
        with SeaweedFS() as server:
            options = storage_options(server.endpoint_url)
            for kind, path in paths.items():
                upload(server.endpoint_url, Path(path), kind)
            bucket = "s3://asyncload-bench"
            started = time.perf_counter()
            wds = tar_shards(f"{bucket}/wds/{{000000..{shards - 1:06d}}}.tar", storage_options=options,
                             index_dir=os.path.join(folder, "indexes"))
            learnt = time.perf_counter() - started
            sources = {"asyncload tar": tar_shards(f"{bucket}/tar", storage_options=options),
                       "mds": mds(f"{bucket}/mds", storage_options=options),
                       "litdata": litdata(f"{bucket}/litdata", storage_options=options), "webdataset tar": wds}
            for number, source in enumerate(sources.values()):
                epoch(source, args.batch_size, 0, options)
            runs: dict[str, list[tuple[float, int, int]]] = {kind: [] for kind in sources}
            kinds = list(sources)
            for number in range(1, args.epochs + 1):
                shift = number % len(kinds)  # each round starts with another format: no place is favoured
                for kind in kinds[shift:] + kinds[:shift]:
                    runs[kind].append(epoch(sources[kind], args.batch_size, number, options))
    base = statistics.median(rate for rate, _, _ in runs["asyncload tar"])
    print(f"{'format':15s} {'img/s':>7s} {'ratio':>6s} {'MB/epoch':>9s} {'requests':>9s}  epochs")
    for kind, values in runs.items():
        rate = statistics.median(rate for rate, _, _ in values)
        _, read, requests = values[-1]
        print(f"{kind:15s} {rate:7.0f} {rate / base:6.2f} {read / 1e6:9.1f} {requests:9d}  "
              f"{', '.join(f'{r:.0f}' for r, _, _ in values)}")
    print(f"webdataset tar: member table learnt from {shards} shards in {learnt:.1f} s before the first epoch (once)")


if __name__ == "__main__":
    main()
