"""A detection-like workload: JPEGs resized to 384, each with 0..30 boxes (N x 4 float32), their
labels (N int64) and a caption; asyncload by default against DataLoader with a list-building
``collate_fn``, both running the same decode, from local disk and from the real S3 server.

- local: ``DetectionDecode`` (the file read, the image decode and resize, the annotation
  lookup), DataLoader with 1-3 workers.
- s3: the same images and annotations as WebDataset-style tar shards (``.jpg`` + ``.json``
  members) on SeaweedFS on this machine; asyncload reads ``tar_shards(..., members="all")``,
  DataLoader (2-4 workers) the same objects through s3fs, one ranged GET per sample; both decode
  with ``MemberDecode`` (``bench/detection_s3.py``).

All loaders of a source stay open; after a warm-up pass each, every round runs each loader one
epoch, each round starting with another (the drift of a shared box falls on all alike); medians
are printed with the ratio to the best DataLoader, the machine and the load average. Then what a
ragged field costs per sample: one sample written into a batch buffer (fixed fields against a
ragged field, and a caption), and one batch's hand-out (the jagged tensor gathered).

    python -m bench.detection [--samples 512] [--batch 32] [--epochs 2] [--source both] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from asyncload import AsyncLoader, ImageDecoder
from asyncload.batch.assemble import assemble
from asyncload.batch.buffers import BufferRing
from asyncload.batch.layout import SampleLayout
from asyncload.batch.ragged import grow
from bench.detection_s3 import s3_loaders
from bench.harness.contenders.dataloader import shut_down_workers
from bench.harness.dataset import ensure_image_set, list_image_folder
from bench.harness.machine import cpu_model
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


def epoch_rate(loader: Any) -> float:
    """Samples/s of one pass."""
    started, seen = time.perf_counter(), 0
    for batch in loader:
        seen += len(batch["caption"])
    return seen / (time.perf_counter() - started)


def interleaved(loaders: dict[str, Any], rounds: int) -> dict[str, float]:
    """Median samples/s of each loader over ``rounds`` passes, after one warm-up pass each; each
    round runs every loader once, starting with another, so that the drift of a shared box falls
    on all of them alike."""
    for loader in loaders.values():
        epoch_rate(loader)
    names, rates = list(loaders), {name: [] for name in loaders}
    for number in range(rounds):
        shift = number % len(names)
        for name in names[shift:] + names[:shift]:
            rates[name].append(epoch_rate(loaders[name]))
    return {name: statistics.median(values) for name, values in rates.items()}


@contextlib.contextmanager
def local_loaders(decode: DetectionDecode, batch: int, workers: tuple[int, ...]) -> Iterator[dict[str, Any]]:
    """asyncload by default and a DataLoader per worker count (persistent workers), all open."""
    samples = len(decode.paths)
    with AsyncLoader(list(range(samples)), batch_size=batch, read=False, decode=decode) as loader:
        out: dict[str, Any] = {"asyncload default": loader}
        for count in workers:
            out[f"DataLoader workers={count}"] = DataLoader(
                DetectionSet(decode), batch_size=batch, shuffle=True, num_workers=count, collate_fn=list_collate,
                persistent_workers=True, prefetch_factor=4)
        try:
            yield out
        finally:
            for name, value in out.items():
                if name.startswith("DataLoader"):
                    shut_down_workers(value)


def summary(rates: dict[str, float], loaders: dict[str, Any]) -> dict[str, Any]:
    best = max((name for name in rates if name.startswith("DataLoader")), key=rates.__getitem__)
    return {"samples/s": rates, "best DataLoader": best,
            "asyncload / best DataLoader": rates["asyncload default"] / rates[best],
            "asyncload chose": loaders["asyncload default"].stats.processes_choice}


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


def load() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=2, help="measured rounds (after a warm-up pass)")
    parser.add_argument("--source", choices=("local", "s3", "both"), default="both")
    parser.add_argument("--json")
    args = parser.parse_args()
    print(f"machine: {cpu_model()}, {len(os.sched_getaffinity(0))} usable cores, load average {load()}", flush=True)
    items, _ = list_image_folder(ensure_image_set(image_set(quick=True)))
    paths = [path for path, _ in items][: args.samples]
    notes = annotations(len(paths))
    results: dict[str, Any] = {"machine": cpu_model(), "samples": len(paths), "batch": args.batch}
    if args.source in ("local", "both"):
        with local_loaders(DetectionDecode(paths, notes), args.batch, (1, 2, 3)) as loaders:
            results["local"] = summary(interleaved(loaders, args.epochs), loaders)
        print(json.dumps({"local": results["local"], "load average": load()}, indent=2), flush=True)
    if args.source in ("s3", "both"):
        with tempfile.TemporaryDirectory() as folder:
            with s3_loaders(paths, notes, folder, args.batch, (2, 3, 4), list_collate, SIZE) as loaders:
                results["s3"] = summary(interleaved(loaders, args.epochs), loaders)
        print(json.dumps({"s3": results["s3"], "load average": load()}, indent=2), flush=True)
    results["cost"] = write_cost()
    results["load average"] = load()
    print(json.dumps({"cost": results["cost"], "load average": results["load average"]}, indent=2))
    if args.json:
        with open(args.json, "w") as file:
            json.dump(results, file, indent=2)


if __name__ == "__main__":
    main()
