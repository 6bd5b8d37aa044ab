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
from typing import Any, Hashable

import cv2
import numpy as np
import simplejpeg

from ..batch.layout import Field
from .budget import DEFAULT_MAX_PIXELS, GATED_BYTES, checked_size, held, jpeg_reduction
from .geometry import Box, Plan, centre_square_box, dct_reduction, random_resized_crop_box, snap_box
from .names import LABEL_NAMES, is_image
from .resize import resize_aa_into, resize_centre_crop_into

JPEG_MAGIC = b"\xff\xd8\xff"
_IMREAD_RGB = getattr(cv2, "IMREAD_COLOR_RGB", None)  # OpenCV >= 4.10 converts while decoding


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


def not_bytes(data: Any) -> TypeError:
    """What an ``ImageDecoder`` given something other than bytes says: what it got and what to
    pass, short enough for a ``SampleError``'s line. A dict is a sample of several columns
    (``mds``, ``litdata``, ``tar_shards(..., members="all")``): ``Members`` picks its image and
    label out and decodes the image with this decoder."""
    if not isinstance(data, dict):
        return TypeError(f"ImageDecoder got a {type(data).__name__}, not an image's bytes: give it the bytes "
                         "(a read= or decode= that returns them)")
    keys = [str(key) for key in data]
    image = next((key for key in keys if is_image(key)), keys[0] if keys else "image")
    label = next((key for key in keys if key in LABEL_NAMES), None)
    fields = ", ".join(f'"{name}"' for name in (image, label) if name is not None)
    shown = ", ".join(repr(key) for key in keys[:4]) + (", ..." if len(keys) > 4 else "")
    return TypeError(f"ImageDecoder got a dict ({shown}), not an image's bytes: pass "
                     f"decode=Members({fields}, image=ImageDecoder(...))")


class ImageDecoder:
    """Encoded image bytes -> uint8 ``size x size x 3`` RGB, the pixels torchvision gives: the
    loader's default ``decode``. JPEG through libjpeg-turbo, other formats (PNG, WebP, BMP, TIFF,
    ...) through OpenCV, told apart by their bytes; greyscale, alpha and CMYK become RGB. In the
    loader it writes straight into the batch row, releasing the GIL.

    Random choices (``train=True``) come from ``(seed, key)``, where the loader passes ``key =
    (epoch, index)``: the same run gives the same pixels whatever the thread timing, and each
    epoch new ones. Called without a key (``decoder(data)``, e.g. from a
    ``torch.utils.data.Dataset``) it draws fresh randomness.

    It decodes bytes only: a sample of several columns (``mds``, ``litdata``, ``tar_shards(...,
    members="all")`` give dicts) fails at once, naming its keys and what to pass instead,
    ``Members("image", "label", image=ImageDecoder(...))``.

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
        max_pixels (int or None, default 178,956,970, Pillow's limit): the most pixels an image may
            have, checked from the header before any pixel is decoded; a larger image fails
            alone (``ImageTooLarge``, a ``ValueError``; in the loader a ``SampleError``, skipped
            with ``on_error="skip"``). A JPEG counts the size it is decoded at (a DCT reduction
            can bring it under), a progressive one its full size (its coefficients are kept
            whole); GIF, JPEG 2000, HDR, PFM and AVIF, whose decoders hold 10 to 16 bytes a
            pixel, count 1.7 to 2.7 a pixel. A format whose header is not read (see
            ``headers.py``) is refused. None: no limit.
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
        max_pixels: int | None = DEFAULT_MAX_PIXELS,
    ) -> None:
        self.size = size
        self.train = train
        self.scale = scale
        self.ratio = ratio
        self.flip = flip
        self.seed = seed
        self.antialias = antialias
        self.max_pixels = max_pixels
        # Below this many pixels a JPEG fits the limit at any scale, and its decode (at most 14
        # bytes a pixel: a CMYK coefficient buffer and the image) takes no share of the memory
        # gate: the fast path checks only this.
        self._unchecked_pixels = GATED_BYTES // 14 if max_pixels is None else min(GATED_BYTES // 14, max_pixels)

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

    def plan(self, height: int, width: int, rng: np.random.Generator | None, reducible: bool = True,
             min_reduce: int = 1) -> Plan:
        """The default path's choices for a ``height`` x ``width`` image, drawn from ``rng`` in
        the order ``decode_into`` draws them (box, then flip). ``reducible``: the image can be
        decoded at a reduced DCT scale (a JPEG on the CPU); the crop is then snapped to it.
        ``min_reduce``: the reduction the decode budget asks for, at least."""
        box = random_resized_crop_box(height, width, rng, self.scale, self.ratio) if self.train else None
        side = min(box[2], box[3]) if box else min(height, width)
        reduce = max(dct_reduction(side, self.size), min_reduce) if reducible else 1
        if box is not None:
            box = snap_box(box, reduce, height, width)
        return Plan(box, reduce, self.train and self.flip and rng.random() < 0.5)

    def decode_into(self, data: bytes, out: np.ndarray, key: tuple[int, ...] | None = None) -> None:
        """Decodes ``data`` and writes the transformed image into ``out`` (a batch row)."""
        if not isinstance(data, (bytes, bytearray, memoryview, np.ndarray)):
            raise not_bytes(data)
        rng = self.rng(key) if self.train else None  # eval draws nothing; a generator costs 50 us
        if not self.antialias:
            self._decode_fast_into(data, out, rng)
            return
        if bytes(data[:3]) == JPEG_MAGIC:
            header = simplejpeg.decode_jpeg_header(data)
            height, width = header[:2]
            min_reduce, buffered = self._jpeg_budget(data, header)
            plan = self.plan(height, width, rng, min_reduce=min_reduce)
            with held(buffered + 6 * (height // plan.reduce) * (width // plan.reduce)):
                image = decode_jpeg_reduced(data, height, width, plan.reduce)
                self.transform_into(image, plan, out, (height, width))
            return
        header = checked_size(data, self.max_pixels)
        with held(header[2] if header else 0):
            image = decode_rgb(data)
            height, width = image.shape[:2]
            self.transform_into(image, self.plan(height, width, rng, reducible=False), out, (height, width))

    def _jpeg_budget(self, data: bytes, header: tuple[int, int, str, str]) -> tuple[int, float]:
        """The smallest DCT reduction the limit allows and the coefficient buffer (bytes) of a
        JPEG: (1, 0) at a glance for all but large images."""
        if header[0] * header[1] <= self._unchecked_pixels:
            return 1, 0.0
        return jpeg_reduction(data, header, self.max_pixels)

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
            self._decode_jpeg_fast_into(data, out, rng)
        else:
            header = checked_size(data, self.max_pixels)
            with held(header[2] if header else 0):
                image = decode_rgb(data)
                self._crop_resize_into(image, self._box(image.shape[0], image.shape[1], rng), out)
        if self.train and self.flip and rng.random() < 0.5:
            cv2.flip(out, 1, dst=out)

    def _box(self, height: int, width: int, rng: np.random.Generator | None) -> Box:
        if self.train:
            return random_resized_crop_box(height, width, rng, self.scale, self.ratio)
        return centre_square_box(height, width)

    def _decode_jpeg_fast_into(self, data: bytes, out: np.ndarray, rng: np.random.Generator | None) -> None:
        """Decodes at the smallest DCT scale that keeps the crop at least ``size`` pixels, when
        the crop is at least twice the target (or smaller, if the budget asks), then crops and
        resizes into ``out``."""
        header = simplejpeg.decode_jpeg_header(data)
        height, width = header[:2]
        min_reduce, buffered = self._jpeg_budget(data, header)
        top, left, crop_h, crop_w = box = self._box(height, width, rng)
        min_height, min_width = height, width
        if min(crop_h, crop_w) >= 2 * self.size:
            min_height = math.ceil(self.size * height / crop_h)
            min_width = math.ceil(self.size * width / crop_w)
        min_height, min_width = min(min_height, -(-height // min_reduce)), min(min_width, -(-width // min_reduce))
        with held(buffered + 6 * min_height * min_width):
            image = simplejpeg.decode_jpeg(
                data, colorspace="RGB", min_height=min_height, min_width=min_width, strict=True
            )
            if image.shape[:2] != (height, width):
                sy, sx = image.shape[0] / height, image.shape[1] / width
                box = (int(top * sy), int(left * sx), max(1, round(crop_h * sy)), max(1, round(crop_w * sx)))
            self._crop_resize_into(image, box, out)

    def _crop_resize_into(self, image: np.ndarray, box: Box, out: np.ndarray) -> None:
        top, left, crop_h, crop_w = box
        crop = image[top : top + crop_h, left : left + crop_w]
        # Area averaging antialiases large shrinks but costs ~8x bilinear; below 2x (always the
        # case after a DCT-domain downscale) bilinear loses little.
        large_shrink = min(crop_h, crop_w) >= 2 * self.size
        interpolation = cv2.INTER_AREA if large_shrink else cv2.INTER_LINEAR
        cv2.resize(crop, (self.size, self.size), dst=out, interpolation=interpolation)
