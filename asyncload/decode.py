"""Image decode and transforms, in native code that releases the GIL.

JPEG goes through ``simplejpeg`` (libjpeg-turbo), which can downscale in the DCT domain: when
the crop is at least twice the target size, decoding at 1/2, 1/4 or 1/8 scale skips most of
the inverse DCT and colour conversion, the largest cost of the whole pipeline. Everything else
(PNG, WebP, BMP, TIFF, ...) goes through OpenCV; the format is told by the bytes, not the name.
The crop is a view of the decoded image and the resize writes straight into the batch row
(OpenCV's ``dst=``), so a decoded image is copied once.
"""

from __future__ import annotations

import math
from typing import Hashable

import cv2
import numpy as np
import simplejpeg

from .buffers import Field

JPEG_MAGIC = b"\xff\xd8\xff"
_IMREAD_RGB = getattr(cv2, "IMREAD_COLOR_RGB", None)  # OpenCV >= 4.10 converts while decoding

Box = tuple[int, int, int, int]  # top, left, height, width, in source pixels


def random_resized_crop_box(
    height: int,
    width: int,
    rng: np.random.Generator,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
) -> Box:
    """torchvision's ``RandomResizedCrop.get_params``: a random area and aspect ratio, ten
    tries, then a centre crop clamped to the ratio range."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_ratio[0], log_ratio[1]))
        crop_w = int(round(math.sqrt(target_area * aspect)))
        crop_h = int(round(math.sqrt(target_area / aspect)))
        if 0 < crop_w <= width and 0 < crop_h <= height:
            top = int(rng.integers(0, height - crop_h + 1))
            left = int(rng.integers(0, width - crop_w + 1))
            return top, left, crop_h, crop_w
    in_ratio = width / height
    if in_ratio < ratio[0]:
        crop_w, crop_h = width, int(round(width / ratio[0]))
    elif in_ratio > ratio[1]:
        crop_h, crop_w = height, int(round(height * ratio[1]))
    else:
        crop_w, crop_h = width, height
    return (height - crop_h) // 2, (width - crop_w) // 2, crop_h, crop_w


def centre_square_box(height: int, width: int) -> Box:
    """Shorter side resized to the target, then a centre crop: the same as cropping the centred
    square of the shorter side and resizing it."""
    side = min(height, width)
    return (height - side) // 2, (width - side) // 2, side, side


def decode_rgb(data: bytes) -> np.ndarray:
    """Any image OpenCV reads -> uint8 HxWx3 RGB (greyscale expanded, alpha dropped, CMYK converted)."""
    if len(data) == 0:
        raise ValueError("empty file: no image data")
    encoded = np.frombuffer(data, dtype=np.uint8)
    if _IMREAD_RGB is not None:
        image = cv2.imdecode(encoded, _IMREAD_RGB)
    else:
        image = cv2.imdecode(encoded, cv2.IMREAD_COLOR)
        if image is not None:
            cv2.cvtColor(image, cv2.COLOR_BGR2RGB, dst=image)
    if image is None:
        raise ValueError(f"not an image OpenCV can decode ({len(data)} bytes, starting {bytes(data[:8])!r})")
    return image


class ImageDecoder:
    """Encoded image bytes -> uint8 ``size x size x 3`` RGB.

    ``train=False``: shorter side to ``size``, centre crop. ``train=True``: torchvision's
    random-resized-crop (``scale``, ``ratio``) and, with ``flip``, a horizontal flip with
    probability 1/2. Random choices come from ``(seed, key)``, where the loader passes
    ``key = (epoch, index)``, so the same run gives the same pixels whatever the thread timing.
    Called without a key (e.g. from a ``torch.utils.data.Dataset``) it draws fresh randomness.
    """

    def __init__(
        self,
        size: int = 224,
        train: bool = False,
        *,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        flip: bool = True,
        seed: int = 0,
    ) -> None:
        self.size = size
        self.train = train
        self.scale = scale
        self.ratio = ratio
        self.flip = flip
        self.seed = seed

    @property
    def field(self) -> Field:
        """The shape and dtype of every output: the batch buffer is allocated from this."""
        return Field((self.size, self.size, 3), np.dtype(np.uint8))

    def __call__(self, data: bytes, key: Hashable | None = None) -> np.ndarray:
        out = np.empty(self.field.shape, dtype=np.uint8)
        self.decode_into(data, out, key)
        return out

    def decode_into(self, data: bytes, out: np.ndarray, key: tuple[int, ...] | None = None) -> None:
        """Decodes ``data`` and writes the transformed image into ``out`` (a batch row)."""
        rng = np.random.default_rng(None if key is None else [self.seed, *key])
        if bytes(data[:3]) == JPEG_MAGIC:
            image, box = self._decode_jpeg(data, rng)
        else:
            image = decode_rgb(data)
            box = self._box(image.shape[0], image.shape[1], rng)
        self._crop_resize_into(image, box, out)
        if self.train and self.flip and rng.random() < 0.5:
            cv2.flip(out, 1, dst=out)

    def _box(self, height: int, width: int, rng: np.random.Generator) -> Box:
        if self.train:
            return random_resized_crop_box(height, width, rng, self.scale, self.ratio)
        return centre_square_box(height, width)

    def _decode_jpeg(self, data: bytes, rng: np.random.Generator) -> tuple[np.ndarray, Box]:
        """Decodes at the smallest DCT scale that keeps the crop at least ``size`` pixels, when
        the crop is at least twice the target; returns the image and the crop in its pixels."""
        height, width, _, _ = simplejpeg.decode_jpeg_header(data)
        box = self._box(height, width, rng)
        top, left, crop_h, crop_w = box
        min_height = min_width = 0
        if min(crop_h, crop_w) >= 2 * self.size:
            min_height = math.ceil(self.size * height / crop_h)
            min_width = math.ceil(self.size * width / crop_w)
        image = simplejpeg.decode_jpeg(
            data, colorspace="RGB", min_height=min_height, min_width=min_width, strict=True
        )
        if image.shape[:2] != (height, width):
            sy, sx = image.shape[0] / height, image.shape[1] / width
            box = (int(top * sy), int(left * sx), max(1, round(crop_h * sy)), max(1, round(crop_w * sx)))
        return image, box

    def _crop_resize_into(self, image: np.ndarray, box: Box, out: np.ndarray) -> None:
        top, left, crop_h, crop_w = box
        crop = image[top : top + crop_h, left : left + crop_w]
        # Area averaging antialiases large shrinks but costs ~8x bilinear; below 2x (always the
        # case after a DCT-domain downscale) bilinear loses little.
        large_shrink = min(crop_h, crop_w) >= 2 * self.size
        interpolation = cv2.INTER_AREA if large_shrink else cv2.INTER_LINEAR
        cv2.resize(crop, (self.size, self.size), dst=out, interpolation=interpolation)
