"""Antialiased resize with torchvision's pixels, written straight into a batch row.

torchvision resizes a PIL image with ``Image.resize(size, BILINEAR)``, which widens the bilinear
kernel by the shrink factor (antialiasing); ``cv2.INTER_LINEAR`` does not, and on a real photo it
ends up 6 to 10 grey levels away. ``torch.nn.functional.interpolate(uint8, mode="bilinear",
antialias=True)`` is the same filter in the same fixed-point arithmetic (equal to PIL's result, at
most one level apart from rounding) and, on one channels-last uint8 image, a single-threaded
AVX2 kernel that releases the GIL: 0.3 ms for 427x427 -> 224x224 where PIL takes 1.0 ms.

Where the output lands matters as much as the filter: half a source pixel of offset costs 6 grey
levels on a photo. So eval reproduces ``Resize(size)`` + ``CenterCrop(size)`` exactly (the whole
image is resized, then cropped), rather than resizing a centred square, whose edges fall up to a
pixel away from torchvision's.
"""

from __future__ import annotations

import numpy as np
import torch

_resize_aa_out = torch.ops.aten._upsample_bilinear2d_aa.out  # what interpolate(antialias=True) calls


def as_nchw(image: np.ndarray) -> torch.Tensor:
    """An HxWxC uint8 array (any strides, e.g. a crop) as a 1xCxHxW channels-last view, no copy."""
    return torch.from_numpy(image).permute(2, 0, 1).unsqueeze(0)


def resize_aa_into(src: np.ndarray, out: np.ndarray) -> None:
    """Resizes ``src`` (HxWxC uint8) to ``out``'s height and width, antialiased bilinear as PIL,
    writing ``out`` in place (a batch row: no intermediate output). A crop is made contiguous
    first: the kernel's fast path takes only dense channels-last input, and on a strided view it
    runs at half speed, far more than the copy costs (0.02 ms for 427x427)."""
    height, width = out.shape[:2]
    source = as_nchw(np.ascontiguousarray(src))
    _resize_aa_out(source, [height, width], False, None, None, out=as_nchw(out))


def resized_shape(height: int, width: int, size: int) -> tuple[int, int]:
    """torchvision's ``Resize(size)``: the shorter side becomes ``size``, the longer one keeps the
    aspect ratio, rounded down (``int(size * long / short)``)."""
    if height <= width:
        return size, int(size * width / height)
    return int(size * height / width), size


def centre_crop_offsets(height: int, width: int, size: int) -> tuple[int, int]:
    """torchvision's ``CenterCrop(size)`` offsets (top, left) in an image of that shape."""
    return int(round((height - size) / 2.0)), int(round((width - size) / 2.0))


def resize_centre_crop_into(image: np.ndarray, out: np.ndarray, source: tuple[int, int] | None = None) -> None:
    """``Resize(size)`` then ``CenterCrop(size)``, as torchvision, into ``out`` (size x size x C).

    ``source``: the (height, width) of the encoded image when ``image`` is a reduced decode of
    it; the geometry must come from it (``int(size * long / short)`` of the reduced sides can
    differ by one, which moves the whole crop). A square image is resized straight into ``out``; otherwise the long axis is resized whole
    (its crop starts at a fraction of a source pixel, which the kernel cannot take as an offset)
    and the centre copied into ``out``: 1/3 more resize work than a square on a 4:3 photo."""
    size = out.shape[0]
    height, width = source or image.shape[:2]
    new_h, new_w = resized_shape(height, width, size)
    if (new_h, new_w) == (size, size):
        resize_aa_into(image, out)
        return
    resized = np.empty((new_h, new_w, image.shape[2]), np.uint8)
    resize_aa_into(image, resized)
    top, left = centre_crop_offsets(new_h, new_w, size)
    np.copyto(out, resized[top : top + size, left : left + size])
