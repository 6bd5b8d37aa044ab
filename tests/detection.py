"""A detection-like data set for the ragged-field tests: each sample an image whose pixels say
its index, ``boxes`` N x 4 float32 and ``labels`` N int64 (N in 0..30, from the index), a caption
``str``. Top-level decoders, so that child processes (processes=2) unpickle them; ``rows`` checks
that every row of a batch holds its own image's fields."""

from __future__ import annotations

import io
import os
import tarfile

import numpy as np
import torch


def count(index: int) -> int:
    return (index * 7) % 31


def sample(index: int, steady: int = 0) -> dict:
    """Sample ``index``; below ``steady`` every sample has 3 boxes (the field is not ragged yet)."""
    n = 3 if index < steady else count(index)
    image = np.zeros((4, 4, 3), np.uint8)
    image[0, 0, 0], image[0, 0, 1] = index % 256, index // 256
    return {"image": image, "boxes": np.arange(n * 4, dtype=np.float32).reshape(n, 4) + index,
            "labels": np.arange(n, dtype=np.int64) + index, "caption": f"image {index}"}


class Detection:
    """``read=False`` decode of an index; ``bad`` indices fail, ``steady`` as ``sample``;
    ``changed``: an index whose boxes come as int32 (a real mismatch)."""

    def __init__(self, bad=(), steady: int = 0, changed: int | None = None) -> None:
        self.bad, self.steady, self.changed = set(bad), steady, changed

    def __call__(self, index: int) -> dict:
        if index in self.bad:
            raise ValueError(f"sample {index} is corrupt")
        out = sample(index, self.steady)
        if index == self.changed:
            out["boxes"] = out["boxes"].astype(np.int32)
        return out


def index_of(image: torch.Tensor) -> int:
    return int(image[0, 0, 0]) + 256 * int(image[0, 0, 1])


def rows(batch: dict, steady: int = 0) -> list[int]:
    """The indices of a batch's rows, checking that each row's boxes, labels and caption are its
    image's (a jagged tensor's ``unbind()``, a list's items)."""
    boxes = batch["boxes"].unbind() if batch["boxes"].is_nested else list(batch["boxes"])
    labels = batch["labels"].unbind() if batch["labels"].is_nested else list(batch["labels"])
    indices = []
    for row, image in enumerate(batch["image"]):
        index = index_of(image)
        want = sample(index, steady)
        assert torch.equal(boxes[row], torch.from_numpy(want["boxes"])), (index, boxes[row])
        assert torch.equal(labels[row], torch.from_numpy(want["labels"])), (index, labels[row])
        assert batch["caption"][row] == want["caption"]
        indices.append(index)
    assert len(boxes) == len(labels) == len(batch["caption"]) == len(indices)
    return indices


def write_npz_files(folder: str, n: int) -> list[str]:
    """One ``.npz`` file a sample (what ``write_shards`` packs as each sample's member)."""
    paths = []
    for index in range(n):
        path = os.path.join(folder, f"{index:04d}.npz")
        want = sample(index)
        np.savez(path, image=want["image"], boxes=want["boxes"], labels=want["labels"], caption=np.array(want["caption"]))
        paths.append(path)
    return paths


def decode_npz(members: dict) -> dict:
    """A tar sample's members (``members="all"``) -> the sample."""
    with np.load(io.BytesIO(members["npz"])) as data:
        return {"image": data["image"], "boxes": data["boxes"], "labels": data["labels"], "caption": str(data["caption"])}


def write_webdataset_tar(path: str, n: int) -> None:
    """A tar as WebDataset's writer lays one out: ``key.image.npy``, ``key.boxes.npy``,
    ``key.labels.npy``, ``key.txt`` side by side."""
    with tarfile.open(path, "w") as tar:
        for index in range(n):
            want = sample(index)
            for ext, data in (("image.npy", _npy(want["image"])), ("boxes.npy", _npy(want["boxes"])),
                              ("labels.npy", _npy(want["labels"])), ("txt", want["caption"].encode())):
                info = tarfile.TarInfo(f"{index:06d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def _npy(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, array)
    return out.getvalue()


def decode_webdataset(members: dict) -> dict:
    def load(ext):
        return np.load(io.BytesIO(members[ext]))
    return {"image": load("image.npy"), "boxes": load("boxes.npy"), "labels": load("labels.npy"),
            "caption": members["txt"].decode()}


def raw_image(data: bytes) -> np.ndarray:
    """A Parquet row's "image": the 48 bytes of the 4x4x3 image."""
    return np.frombuffer(data, np.uint8).reshape(4, 4, 3).copy()


def to_targets(batch: dict) -> tuple[torch.Tensor, list[dict]]:
    """A ``collate=``: torchvision detection's ``(images, list[dict(boxes, labels)])``."""
    targets = [{"boxes": b, "labels": l} for b, l in zip(batch["boxes"].unbind(), batch["labels"].unbind())]
    return batch["image"], targets


def broken_collate(batch: dict) -> None:
    raise KeyError("scores")
