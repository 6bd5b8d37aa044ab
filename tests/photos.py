"""Real photos in every encoding other tools write, and torchvision's pixels for them, from PIL.

The photos are the ones scikit-learn and matplotlib ship (no download): flat colours and synthetic
gradients hide what antialiasing and a sub-pixel offset do to real detail. Each variant is encoded
here, by PIL as a user's files would be (OpenCV for 16-bit PNG, which PIL cannot write in colour).
The reference is torchvision's: ``Image.open(f).convert("RGB")`` (its ImageFolder loader), then
``Resize(size)`` + ``CenterCrop(size)`` or ``resized_crop``, which on a PIL image are
``Image.resize(..., BILINEAR)`` and ``Image.crop``; torchvision itself is used when it imports.
"""

from __future__ import annotations

import io
import os
from functools import cache
from pathlib import Path
from typing import Callable

import cv2
import numpy as np
from PIL import Image

Box = tuple[int, int, int, int]  # top, left, height, width


@cache
def photos() -> dict[str, np.ndarray]:
    """name -> RGB uint8 photo: scikit-learn's china (427x640) and flower, matplotlib's
    grace_hopper (600x512, portrait). ``ASYNCLOAD_TEST_PHOTOS``: a folder holding those three
    JPEG files (``bench/gpu16.sh`` carries them to a GPU box that has neither package)."""
    folder = os.environ.get("ASYNCLOAD_TEST_PHOTOS")
    if folder:
        return {name: np.asarray(Image.open(Path(folder) / f"{name}.jpg").convert("RGB"))
                for name in ("china", "flower", "grace_hopper")}
    import matplotlib
    from sklearn.datasets import load_sample_image

    grace = Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg"
    return {
        "china": load_sample_image("china.jpg"),
        "flower": load_sample_image("flower.jpg"),
        "grace_hopper": np.asarray(Image.open(grace).convert("RGB")),
    }


def _save(image: Image.Image, fmt: str, **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def _with_alpha_ramp(image: Image.Image) -> Image.Image:
    rgba = np.asarray(image.convert("RGBA")).copy()
    rgba[..., 3] = np.linspace(0, 255, rgba.shape[1], dtype=np.uint8)[None, :]
    return Image.fromarray(rgba)


def _png16(image: Image.Image) -> bytes:
    bgr = cv2.cvtColor(np.asarray(image), cv2.COLOR_RGB2BGR).astype(np.uint16) * 257
    return cv2.imencode(".png", bgr)[1].tobytes()


VARIANTS: dict[str, Callable[[Image.Image], bytes]] = {
    "jpeg_q90_420": lambda im: _save(im, "JPEG", quality=90),
    "jpeg_progressive": lambda im: _save(im, "JPEG", quality=90, progressive=True),
    "jpeg_greyscale": lambda im: _save(im.convert("L"), "JPEG", quality=90),
    "jpeg_cmyk": lambda im: _save(im.convert("CMYK"), "JPEG", quality=90),
    "jpeg_444": lambda im: _save(im, "JPEG", quality=95, subsampling=0),
    "png_rgba": lambda im: _save(_with_alpha_ramp(im), "PNG"),
    "png_palette": lambda im: _save(im.convert("P", palette=Image.Palette.ADAPTIVE), "PNG"),
    "png_16bit": _png16,
    "webp": lambda im: _save(im, "WEBP", quality=90),
    "bmp": lambda im: _save(im, "BMP"),
}


@cache
def encoded(photo: str, variant: str) -> bytes:
    return VARIANTS[variant](Image.fromarray(photos()[photo]))


def pil_rgb(data: bytes) -> Image.Image:
    """What torchvision's ImageFolder loads."""
    return Image.open(io.BytesIO(data)).convert("RGB")


def _torchvision_transforms():  # noqa: ANN202 - the module, or None
    try:  # a torchvision built for another torch fails with errors other than ImportError
        from torchvision import transforms
    except Exception:
        return None
    return transforms


def reference_eval(data: bytes, size: int) -> np.ndarray:
    """torchvision's ``Resize(size)`` + ``CenterCrop(size)`` on the PIL image."""
    image = pil_rgb(data)
    transforms = _torchvision_transforms()
    if transforms is not None:
        return np.asarray(transforms.CenterCrop(size)(transforms.Resize(size)(image)))
    width, height = image.size
    if width <= height:
        new_w, new_h = size, int(size * height / width)
    else:
        new_w, new_h = int(size * width / height), size
    resized = image.resize((new_w, new_h), Image.BILINEAR)
    top, left = int(round((new_h - size) / 2.0)), int(round((new_w - size) / 2.0))
    return np.asarray(resized.crop((left, top, left + size, top + size)))


def reference_crop(data: bytes, box: Box, size: int, flip: bool = False) -> np.ndarray:
    """torchvision's ``resized_crop`` of ``box`` to ``size`` (what RandomResizedCrop applies),
    then the horizontal flip."""
    top, left, height, width = box
    image = pil_rgb(data).crop((left, top, left + width, top + height)).resize((size, size), Image.BILINEAR)
    out = np.asarray(image)
    return out[:, ::-1] if flip else out


def mean_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.int16) - b.astype(np.int16)).mean())
