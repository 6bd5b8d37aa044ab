"""The S3 variant of ``bench.detection``: the same JPEGs and annotations as WebDataset-style tar
shards (a ``.jpg`` and a ``.json`` member per sample, written by webdataset's ``ShardWriter``,
indexed by ``index_shards``) on the real S3 server (SeaweedFS, on this machine).

asyncload reads them with ``tar_shards(..., members="all")``; DataLoader reads the very same
objects through s3fs, one ranged GET per sample (the sample's members are consecutive in its
shard, and ``index.json`` says where), as a map-style ``Dataset`` must. Both run one decode,
``MemberDecode``: the image decoded and resized, the JSON parsed into boxes, labels and caption.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
from torch.utils.data import DataLoader, Dataset

from asyncload import AsyncLoader, ImageDecoder, index_shards, tar_shards
from bench.harness.contenders.dataloader import shut_down_workers
from bench.harness.s3data import S3_POOL
from bench.harness.tasks import S3_READ_KWARGS, s3_options, sync_s3

BUCKET, PREFIX = "asyncload-bench", "detection"
SAMPLES_PER_SHARD = 128

Notes = list[tuple[np.ndarray, np.ndarray, str]]


def write_tars(paths: list[str], notes: Notes, folder: str) -> str:
    """Writes the samples as tar shards in ``folder`` with their ``index.json``; returns its path."""
    import webdataset as wds

    with wds.ShardWriter(os.path.join(folder, "%06d.tar"), maxcount=SAMPLES_PER_SHARD, verbose=0) as sink:
        for number, (path, (boxes, labels, caption)) in enumerate(zip(paths, notes)):
            note = {"boxes": boxes.tolist(), "labels": labels.tolist(), "caption": caption}
            sink.write({"__key__": f"{number:08d}", "jpg": Path(path).read_bytes(), "json": json.dumps(note).encode()})
    return index_shards(sorted(glob.glob(os.path.join(folder, "*.tar"))))


class MemberDecode:
    """{"jpg": bytes, "json": bytes} -> {"image", "boxes", "labels", "caption"}: the one decode
    both loaders run (what a WebDataset user writes for a detection set)."""

    def __init__(self, size: int) -> None:
        self.image = ImageDecoder(size=size)

    def __call__(self, members: dict[str, bytes]) -> dict[str, Any]:
        note = json.loads(members["json"])
        return {"image": self.image(members["jpg"]),
                "boxes": np.asarray(note["boxes"], np.float32).reshape(-1, 4),
                "labels": np.asarray(note["labels"], np.int64), "caption": note["caption"]}


class S3Samples(Dataset):
    """Index -> decoded sample, read from its shard on S3 with one ranged GET through s3fs."""

    def __init__(self, index_path: str, url: str, options: dict, decode: MemberDecode) -> None:
        with open(index_path) as file:
            index = json.load(file)
        self.spans = [(f"{url}/{shard['url']}", members) for shard in index["shards"] for members in shard["members"]]
        self.options, self.decode = options, decode

    def __len__(self) -> int:
        return len(self.spans)

    def __getitem__(self, index: int) -> dict[str, Any]:
        url, members = self.spans[index]
        start = min(offset for _, offset, _ in members)
        end = max(offset + size for _, offset, size in members)
        data = sync_s3(self.options).cat_file(url, start=start, end=end, **S3_READ_KWARGS)
        return self.decode({ext: data[offset - start: offset - start + size] for ext, offset, size in members})


def upload(endpoint_url: str, folder: str) -> None:
    """Copies the shards and their index to s3://asyncload-bench/detection/."""
    fs = sync_s3(s3_options(endpoint_url, S3_POOL))
    if not fs.exists(BUCKET):
        fs.mkdir(BUCKET)
    fs.pipe({f"{BUCKET}/{PREFIX}/{name}": Path(folder, name).read_bytes() for name in sorted(os.listdir(folder))})


@contextlib.contextmanager
def s3_loaders(paths: list[str], notes: Notes, folder: str, batch: int, workers: tuple[int, ...],
               collate: Callable, size: int) -> Iterator[dict[str, Any]]:
    """SeaweedFS started with the shards on it; yields asyncload by default and a DataLoader per
    worker count (persistent workers), all open for interleaved rounds."""
    from tests.support.s3server import S3_ENV, SeaweedFS

    index_path = write_tars(paths, notes, folder)
    os.environ.update(S3_ENV)
    with SeaweedFS() as server, contextlib.ExitStack() as stack:
        upload(server.endpoint_url, folder)
        options = s3_options(server.endpoint_url, S3_POOL)
        url = f"s3://{BUCKET}/{PREFIX}"
        source = tar_shards(url, members="all", storage_options=options)
        out: dict[str, Any] = {"asyncload default": stack.enter_context(
            AsyncLoader(source, batch_size=batch, decode=MemberDecode(size), storage_options=options))}
        for count in workers:
            loader = DataLoader(S3Samples(index_path, url, options, MemberDecode(size)), batch_size=batch,
                                shuffle=True, num_workers=count, collate_fn=collate, persistent_workers=True,
                                prefetch_factor=4)
            stack.callback(shut_down_workers, loader)
            out[f"DataLoader workers={count}"] = loader
        yield out
