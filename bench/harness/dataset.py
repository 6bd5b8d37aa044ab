"""The benchmark's data: an ImageNet-like JPEG folder generated on first use, cached under bench/data/.

The images must cost what real photos cost to read and decode, so they are neither flat (tiny files,
trivially fast to decode) nor pure noise (huge files, entropy-decoder bound): a smooth colour field,
a few anti-aliased shapes and lines (edges), and a mid-frequency per-channel texture. At 500x375 and
quality 90 that gives ~100 KB per file, close to an ImageNet training JPEG.

Every image is a pure function of (seed, index), so the set is identical on every machine and the
generator can run in any number of processes.
"""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import cv2
import numpy as np
import simplejpeg

DATA_ROOT = Path(__file__).resolve().parent.parent / "data"
GENERATOR_VERSION = 1
HEIGHT, WIDTH = 375, 500


@dataclass(frozen=True)
class ImageSetSpec:
    """What an image folder holds; its JSON form is the cache key."""

    name: str
    count: int
    classes: int
    seed: int = 0
    quality: int = 90
    version: int = GENERATOR_VERSION

    @property
    def root(self) -> Path:
        return DATA_ROOT / self.name


def synth_image(seed: int, index: int) -> np.ndarray:
    """One RGB uint8 image (375, 500, 3), deterministic from (seed, index)."""
    rng = np.random.default_rng([seed, index])
    base = rng.integers(0, 256, (3, 4, 3), dtype=np.uint8)
    img = cv2.resize(base, (WIDTH, HEIGHT), interpolation=cv2.INTER_CUBIC).astype(np.int16)
    for _ in range(int(rng.integers(3, 9))):  # blobs: flat regions with sharp, anti-aliased edges
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        centre = (int(rng.integers(0, WIDTH)), int(rng.integers(0, HEIGHT)))
        axes = (int(rng.integers(10, 150)), int(rng.integers(10, 120)))
        cv2.ellipse(img, centre, axes, float(rng.uniform(0, 180)), 0, 360, colour, -1, cv2.LINE_AA)
    for _ in range(int(rng.integers(2, 6))):  # thin lines: high-frequency edges
        p1 = (int(rng.integers(0, WIDTH)), int(rng.integers(0, HEIGHT)))
        p2 = (int(rng.integers(0, WIDTH)), int(rng.integers(0, HEIGHT)))
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        cv2.line(img, p1, p2, colour, int(rng.integers(1, 5)), cv2.LINE_AA)
    amp = int(rng.integers(20, 41))  # texture strength varies, so file sizes vary as photos do
    tex = rng.integers(-amp, amp + 1, (HEIGHT // 2 + 1, WIDTH // 2 + 1, 3), dtype=np.int16)
    tex = cv2.resize(tex.astype(np.float32), (WIDTH, HEIGHT), interpolation=cv2.INTER_LINEAR)
    return np.clip(img + tex.astype(np.int16), 0, 255).astype(np.uint8)


def class_name(label: int) -> str:
    return f"n{label:05d}"


def _write_chunk(args: tuple[ImageSetSpec, int, int]) -> int:
    """Encode images [start, stop) of a set; returns bytes written. Runs in a pool process."""
    spec, start, stop = args
    total = 0
    for index in range(start, stop):
        label = index % spec.classes
        data = simplejpeg.encode_jpeg(synth_image(spec.seed, index), quality=spec.quality)
        path = spec.root / class_name(label) / f"{index // spec.classes}.jpg"
        path.write_bytes(data)
        total += len(data)
    return total


def ensure_image_set(spec: ImageSetSpec, workers: int | None = None) -> Path:
    """Generate the folder unless a complete one with the same spec is cached; returns its root."""
    marker = spec.root / ".complete.json"
    if marker.exists() and json.loads(marker.read_text()) == asdict(spec):
        return spec.root
    print(f"generating {spec.count} images in {spec.root} (once; cached)", flush=True)
    shutil.rmtree(spec.root, ignore_errors=True)
    for label in range(spec.classes):
        (spec.root / class_name(label)).mkdir(parents=True, exist_ok=True)
    workers = workers or os.cpu_count() or 1
    step = max(1, spec.count // (workers * 8))
    chunks = [(spec, i, min(i + step, spec.count)) for i in range(0, spec.count, step)]
    with ProcessPoolExecutor(workers) as pool:
        sum(pool.map(_write_chunk, chunks))
    marker.write_text(json.dumps(asdict(spec)))
    return spec.root


def list_image_folder(root: str | Path) -> tuple[list[tuple[str, int]], list[str]]:
    """(path, label) pairs in the order image_folder uses: sorted class folders, sorted files.

    Every contender reads this same list, so they see exactly the same samples and labels."""
    root = Path(root)
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    items = []
    for label, name in enumerate(classes):
        files = sorted((root / name).glob("*.jpg"), key=lambda p: p.name)
        items.extend((str(p), label) for p in files)
    return items, classes


def dataset_bytes(items: list[tuple[str, int]]) -> int:
    return sum(os.path.getsize(path) for path, _ in items)
