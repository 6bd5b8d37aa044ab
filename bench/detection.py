"""A detection-like workload: JPEGs resized to 384, each with 0..30 boxes (N x 4 float32), their
labels (N int64) and a caption; asyncload by default against DataLoader with a list-building
``collate_fn``, both running the same decode (``DetectionDecode``: the file read, the image
decode and resize, the annotation lookup). Then what a ragged field costs per sample: one
sample written into a batch buffer (fixed fields against a ragged field, and a caption), and
one batch's hand-out (the jagged tensor gathered).

    python -m bench.detection [--samples 512] [--batch 32] [--epochs 2] [--json PATH]

Local disk only (the S3 variant is left to ``python -m bench``'s harness).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from asyncload import AsyncLoader, ImageDecoder
from asyncload.batch.assemble import assemble
from asyncload.batch.buffers import BufferRing
from asyncload.batch.layout import SampleLayout
from asyncload.batch.ragged import grow
from bench.harness.dataset import ensure_image_set, list_image_folder
from bench.harness.workloads import image_set

SIZE = 384


def annotations(count: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray, str]]:
    rng = np.random.default_rng(seed)
    out = []
    for index in range(count):
        n = int(rng.integers(0, 31))
        boxes = np.sort(rng.uniform(0, SIZE, (n, 4)).astype(np.float32), axis=1)
        out.append((boxes, rng.integers(1, 91, n), f"image {index} with {n} objects"))
    return out


class DetectionDecode:
    """Index -> {"image", "boxes", "labels", "caption"}: the one decode both loaders run."""

    def __init__(self, paths: list[str], notes: list[tuple[np.ndarray, np.ndarray, str]]) -> None:
        self.paths, self.notes = paths, notes
        self.image = ImageDecoder(size=SIZE)

    def __call__(self, index: int) -> dict[str, Any]:
        with open(self.paths[index], "rb") as file:
            data = file.read()
        boxes, labels, caption = self.notes[index]
        return {"image": self.image(data), "boxes": boxes, "labels": labels, "caption": caption}


class DetectionSet(Dataset):
    def __init__(self, decode: DetectionDecode) -> None:
        self.decode = decode

    def __len__(self) -> int:
        return len(self.decode.paths)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.decode(index)


def list_collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """What a detection user writes for DataLoader: images stacked, the rest as lists."""
    return {"image": torch.stack([torch.from_numpy(s["image"]) for s in samples]),
            "boxes": [torch.from_numpy(s["boxes"]) for s in samples],
            "labels": [torch.from_numpy(s["labels"]) for s in samples],
            "caption": [s["caption"] for s in samples]}


def rate(loader: Any, epochs: int, samples: int) -> float:
    """Samples/s over ``epochs`` passes, after one warm-up pass."""
    for _ in loader:
        pass
    started = time.perf_counter()
    for _ in range(epochs):
        for _ in loader:
            pass
    return epochs * samples / (time.perf_counter() - started)


def loaders(decode: DetectionDecode, batch: int, epochs: int) -> dict[str, float]:
    samples = len(decode.paths)
    out = {}
    with AsyncLoader(list(range(samples)), batch_size=batch, read=False, decode=decode) as loader:
        out["asyncload default"] = rate(loader, epochs, samples)
    for workers in (1, 2, 3):
        loader = DataLoader(DetectionSet(decode), batch_size=batch, shuffle=True, num_workers=workers,
                            collate_fn=list_collate, persistent_workers=True, prefetch_factor=4)
        out[f"DataLoader workers={workers}"] = rate(loader, epochs, samples)
        del loader
    return out


def write_cost(rows: int = 256, repeat: int = 20) -> dict[str, float]:
    """Microseconds to write one sample into its row (fixed fields; boxes ragged; and a caption),
    and to hand out one batch of ``rows`` as tensors (per sample)."""
    rng = np.random.default_rng(0)
    image = np.zeros((64, 64, 3), np.uint8)
    lengths = rng.integers(0, 31, rows)
    fixed = [{"image": image, "boxes": np.ones((16, 4), np.float32)} for _ in range(rows)]
    ragged = [{"image": image, "boxes": np.ones((n, 4), np.float32)} for n in lengths]
    captioned = [{**sample, "caption": "a caption"} for sample in ragged]
    out = {}
    for name, samples in (("fixed", fixed), ("ragged boxes", ragged), ("ragged boxes + caption", captioned)):
        layout = SampleLayout.of(samples[0])
        side = {(row, 1): samples[row]["boxes"] for row in range(rows) if len(samples[row]["boxes"]) != 16}
        if name != "fixed":
            layout = grow(layout, {key: value for key, value in side.items()})
        ring = BufferRing(keep=2, pin_memory=False)
        ring.configure(layout, rows)
        buffer = ring.take()
        started = time.perf_counter()
        for _ in range(repeat):
            for row, sample in enumerate(samples):
                buffer.write(row, sample)
        out[f"write {name} (us/sample)"] = (time.perf_counter() - started) / (repeat * rows) * 1e6
        layout.unflatten(assemble(buffer, buffer.views(rows), rows, layout))  # warm: torch's first nested tensor
        started = time.perf_counter()
        for _ in range(repeat):
            if layout.leaves is None:
                buffer.batch(rows)
            else:
                layout.unflatten(assemble(buffer, buffer.views(rows), rows, layout))
        out[f"hand-out {name} (us/sample)"] = (time.perf_counter() - started) / (repeat * rows) * 1e6
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args()
    items, _ = list_image_folder(ensure_image_set(image_set(quick=True)))
    paths = [path for path, _ in items][: args.samples]
    decode = DetectionDecode(paths, annotations(len(paths)))
    results: dict[str, Any] = {"samples/s": loaders(decode, args.batch, args.epochs), "cost": write_cost()}
    best = max(value for name, value in results["samples/s"].items() if name.startswith("DataLoader"))
    results["asyncload / best DataLoader"] = results["samples/s"]["asyncload default"] / best
    print(json.dumps(results, indent=2))
    if args.json:
        with open(args.json, "w") as file:
            json.dump(results, file, indent=2)


if __name__ == "__main__":
    main()
