"""Image decode and transforms, in native code that releases the GIL.

JPEG goes through ``simplejpeg`` (libjpeg-turbo), everything else (PNG, WebP, BMP, TIFF, ...)
through OpenCV; the format is told by the bytes, not the name. Both decode to the same pixels as
PIL's ``Image.open(f).convert("RGB")``, torchvision's ImageFolder loader, on every variant tested.

The default resize is torchvision's (antialiased bilinear, see ``resize.py``), written straight
into the batch row. ``antialias=False`` keeps the older, faster path: OpenCV bilinear (area
averaging past a 2x shrink), 2 to 10 grey levels (mean) away from torchvision on a photo.

libjpeg-turbo can also downscale in the DCT domain, decoding at 1/2, 1/4 or 1/8 scale and
skipping most of the inverse DCT and colour conversion, the largest cost of the whole pipeline.
That reduction is not torchvision's filter: measured on real photos it stays within a grey level
of it only while the antialiased resize still shrinks at least 4x after it (2 to 5 levels at
1.7-1.9x), so the default uses it only past an 8x shrink (photos far larger than the crop), and
snaps the crop to whole DCT-scaled pixels, since a fraction of a pixel of offset costs more than
the filter does. The fast path uses it from a 2x shrink, as before.
"""

from __future__ import annotations

import math
from typing import Hashable, NamedTuple

import cv2
import numpy as np
import simplejpeg

from ..batch.layout import Field
from .resize import resize_aa_into, resize_centre_crop_into

JPEG_MAGIC = b"\xff\xd8\xff"
_IMREAD_RGB = getattr(cv2, "IMREAD_COLOR_RGB", None)  # OpenCV >= 4.10 converts while decoding

Box = tuple[int, int, int, int]  # top, left, height, width, in source pixels
EXACT_SHRINK = 4  # the default decodes at a reduced DCT scale only if the resize still shrinks this much after it


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


class Plan(NamedTuple):
    """The random choices for one image: the crop (``None`` in eval, where the transform is
    torchvision's Resize + CenterCrop of the whole image), the DCT reduction and the flip."""

    box: Box | None
    reduce: int
    flip: bool


def dct_reduction(side: int, size: int, min_shrink: float = EXACT_SHRINK) -> int:
    """The largest of 8, 4, 2 (else 1) that leaves a crop side of ``side`` source pixels still
    ``min_shrink`` times the target ``size`` once decoded at that reduced scale."""
    for reduce in (8, 4, 2):
        if side >= min_shrink * size * reduce:
            return reduce
    return 1


def snap_box(box: Box, reduce: int, height: int, width: int) -> Box:
    """The crop moved to whole pixels of the image decoded at 1/``reduce`` scale (at most
    ``reduce // 2`` source pixels away), kept inside it; returned in source pixels."""
    if reduce == 1:
        return box
    top, left, crop_h, crop_w = (round(value / reduce) for value in box)
    crop_h = max(1, min(crop_h, height // reduce))
    crop_w = max(1, min(crop_w, width // reduce))
    top = min(top, height // reduce - crop_h)
    left = min(left, width // reduce - crop_w)
    return top * reduce, left * reduce, crop_h * reduce, crop_w * reduce


def decode_jpeg_reduced(data: bytes, height: int, width: int, reduce: int) -> np.ndarray:
    """A JPEG decoded to RGB at 1/``reduce`` scale, cut to the pixels that stand for ``reduce``
    whole source pixels. ``strict``: a truncated or corrupt file raises instead of coming back
    grey-filled."""
    if reduce == 1:
        return simplejpeg.decode_jpeg(data, colorspace="RGB", strict=True)
    min_height, min_width = -(-height // reduce), -(-width // reduce)
    image = simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=min_height, min_width=min_width, strict=True)
    if image.shape[:2] != (min_height, min_width):
        raise ValueError(f"JPEG decoded at {image.shape[:2]}, not at 1/{reduce} of {(height, width)}")
    return image[: height // reduce, : width // reduce]  # whole blocks: the last may be partial


class ImageDecoder:
    """Encoded image bytes -> uint8 ``size x size x 3`` RGB, the pixels torchvision gives: the
    loader's default ``decode``. JPEG through libjpeg-turbo, other formats (PNG, WebP, BMP, TIFF,
    ...) through OpenCV, told apart by their bytes; greyscale, alpha and CMYK become RGB. In the
    loader it writes straight into the batch row, releasing the GIL.

    Random choices (``train=True``) come from ``(seed, key)``, where the loader passes ``key =
    (epoch, index)``: the same run gives the same pixels whatever the thread timing, and each
    epoch new ones. Called without a key (``decoder(data)``, e.g. from a
    ``torch.utils.data.Dataset``) it draws fresh randomness.

    Args:
        size (int, default 224): the side of every output image.
        train (bool, default False): False is torchvision's ``Resize(size)`` + ``CenterCrop(size)``
            (evaluation: the shorter side to ``size``, the centre kept). True is
            ``RandomResizedCrop(size, scale, ratio)`` and, with ``flip``, ``RandomHorizontalFlip``
            (training).
        scale ((float, float), default (0.08, 1.0)): with ``train``, the range of the crop's area
            as a fraction of the image's, as ``RandomResizedCrop``.
        ratio ((float, float), default (3/4, 4/3)): with ``train``, the range of the crop's aspect
            ratio (width / height), as ``RandomResizedCrop``.
        flip (bool, default True): with ``train``, a horizontal flip with probability 1/2; False
            for images where left and right differ in meaning (text, some medical images).
        seed (int, default 0): the seed of the random crops and flips, with the epoch and the
            sample's index; change it for another augmentation stream with the same order.
        antialias (bool, default True): torchvision's antialiased resize. False is the fast
            option: OpenCV bilinear without antialiasing, the eval crop a centred square; 0.15 to
            0.3 ms less per 500x375 JPEG (of ~1.7 ms), and 2 to 10 grey levels (mean) away from
            torchvision on a photo.
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
        antialias: bool = True,
    ) -> None:
        self.size = size
        self.train = train
        self.scale = scale
        self.ratio = ratio
        self.flip = flip
        self.seed = seed
        self.antialias = antialias

    @property
    def field(self) -> Field:
        """The shape and dtype of every output: the batch buffer is allocated from this."""
        return Field((self.size, self.size, 3), np.dtype(np.uint8))

    def __call__(self, data: bytes, key: Hashable | None = None) -> np.ndarray:
        out = np.empty(self.field.shape, dtype=np.uint8)
        self.decode_into(data, out, key)
        return out

    def rng(self, key: tuple[int, ...] | None) -> np.random.Generator:
        """The random stream of one sample: from ``(seed, *key)``, fresh without a key."""
        return np.random.default_rng(None if key is None else [self.seed, *key])

    def plan(self, height: int, width: int, rng: np.random.Generator | None, reducible: bool = True) -> Plan:
        """The default path's choices for a ``height`` x ``width`` image, drawn from ``rng`` in
        the order ``decode_into`` draws them (box, then flip). ``reducible``: the image can be
        decoded at a reduced DCT scale (a JPEG on the CPU); the crop is then snapped to it."""
        box = random_resized_crop_box(height, width, rng, self.scale, self.ratio) if self.train else None
        side = min(box[2], box[3]) if box else min(height, width)
        reduce = dct_reduction(side, self.size) if reducible else 1
        if box is not None:
            box = snap_box(box, reduce, height, width)
        return Plan(box, reduce, self.train and self.flip and rng.random() < 0.5)

    def decode_into(self, data: bytes, out: np.ndarray, key: tuple[int, ...] | None = None) -> None:
        """Decodes ``data`` and writes the transformed image into ``out`` (a batch row)."""
        rng = self.rng(key) if self.train else None  # eval draws nothing; a generator costs 50 us
        if not self.antialias:
            self._decode_fast_into(data, out, rng)
            return
        if bytes(data[:3]) == JPEG_MAGIC:
            height, width, _, _ = simplejpeg.decode_jpeg_header(data)
            plan = self.plan(height, width, rng)
            image = decode_jpeg_reduced(data, height, width, plan.reduce)
        else:
            image = decode_rgb(data)
            height, width = image.shape[:2]
            plan = self.plan(height, width, rng, reducible=False)
        self.transform_into(image, plan, out, (height, width))

    def transform_into(self, image: np.ndarray, plan: Plan, out: np.ndarray, source: tuple[int, int]) -> None:
        """Crops, resizes and flips a decoded image (at 1/``plan.reduce`` scale of a ``source``
        (height, width) image) into ``out``."""
        if plan.box is None:
            resize_centre_crop_into(image, out, source)
        else:
            top, left, crop_h, crop_w = (value // plan.reduce for value in plan.box)
            resize_aa_into(image[top : top + crop_h, left : left + crop_w], out)
        if plan.flip:
            cv2.flip(out, 1, dst=out)

    def _decode_fast_into(self, data: bytes, out: np.ndarray, rng: np.random.Generator | None) -> None:
        """``antialias=False``: the path before antialiasing, unchanged."""
        if bytes(data[:3]) == JPEG_MAGIC:
            image, box = self._decode_jpeg(data, rng)
        else:
            image = decode_rgb(data)
            box = self._box(image.shape[0], image.shape[1], rng)
        self._crop_resize_into(image, box, out)
        if self.train and self.flip and rng.random() < 0.5:
            cv2.flip(out, 1, dst=out)

    def _box(self, height: int, width: int, rng: np.random.Generator | None) -> Box:
        if self.train:
            return random_resized_crop_box(height, width, rng, self.scale, self.ratio)
        return centre_square_box(height, width)

    def _decode_jpeg(self, data: bytes, rng: np.random.Generator | None) -> tuple[np.ndarray, Box]:
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
