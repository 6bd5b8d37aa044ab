"""Where the pixels of one image come from: torchvision's random and centre crops, in source
pixels, and the DCT reduction a JPEG is decoded at (see ``image.py`` for why past an 8x shrink)."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

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
