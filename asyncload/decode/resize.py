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
WHOLE_RESIZE_LIMIT = 4  # eval resizes the whole long axis up to 4x the output side, then crops
PRECISION_BITS = 22  # PIL's fixed point for 8-bit resampling (Resample.c: 32 - 8 - 2)


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
    and the centre copied into ``out``: 1/3 more resize work than a square on a 4:3 photo. Past
    an aspect ratio of ``WHOLE_RESIZE_LIMIT``, only the lines the crop keeps are resized
    (``centre_crop_lines_into``): a 20000x1 image would otherwise need a 224 x 4,480,000 image."""
    size = out.shape[0]
    height, width = source or image.shape[:2]
    new_h, new_w = resized_shape(height, width, size)
    if (new_h, new_w) == (size, size):
        resize_aa_into(image, out)
        return
    if max(new_h, new_w) > WHOLE_RESIZE_LIMIT * size:
        centre_crop_lines_into(image, out, new_h, new_w)
        return
    resized = np.empty((new_h, new_w, image.shape[2]), np.uint8)
    resize_aa_into(image, resized)
    top, left = centre_crop_offsets(new_h, new_w, size)
    np.copyto(out, resized[top : top + size, left : left + size])


def aa_coefficients(in_size: int, out_size: int, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """PIL's antialiased bilinear filter (``Resample.c``: ``precompute_coeffs`` and its 22-bit fixed
    point) for output lines ``start`` to ``start + count`` of a resize of ``in_size`` lines to
    ``out_size``, in the same floating-point steps: the first input line of each output line, and
    the integer weights, ``count x taps`` (zero past each line's support)."""
    scale = in_size / out_size
    filterscale = max(scale, 1.0)
    support = filterscale  # bilinear: a support of 1, widened by the shrink
    centre = (np.arange(start, start + count) + 0.5) * scale
    first = np.maximum((centre - support + 0.5).astype(np.int64), 0)  # C's (int): toward zero
    spans = np.minimum((centre + support + 0.5).astype(np.int64), in_size) - first
    inverse = 1.0 / filterscale
    weights = np.zeros((count, int(spans.max())))
    total = np.zeros(count)
    for tap in range(weights.shape[1]):  # summed in PIL's order, tap by tap
        weight = np.maximum(0.0, 1.0 - np.abs((tap + first - centre + 0.5) * inverse))
        weights[:, tap] = np.where(tap < spans, weight, 0.0)
        total += weights[:, tap]
    weights = np.divide(weights, total[:, None], out=weights, where=total[:, None] != 0)
    return first, (0.5 + weights * (1 << PRECISION_BITS)).astype(np.int64)


def aa_lines(source: torch.Tensor, dim: int, first: np.ndarray, weights: np.ndarray) -> torch.Tensor:
    """The output lines of ``aa_coefficients`` along ``dim`` of a uint8 tensor (any device) whose
    line 0 is input line 0 of ``first``: uint8, rounded as PIL rounds. One line's worth of int64
    per tap at a time, so a thin image's pass takes what its output does. The taps' indices and
    weights go to the device in one copy each, from pinned memory on a GPU (a pageable copy would
    wait for the stream's queued work, once per tap)."""
    shape = [1] * source.dim()
    shape[dim] = len(first)
    taps = weights.shape[1]
    indices = np.minimum(first[None, :] + np.arange(taps)[:, None], source.shape[dim] - 1)  # taps x lines
    indices, weights_t = torch.from_numpy(indices), torch.from_numpy(np.ascontiguousarray(weights.T))
    if source.is_cuda:
        indices = indices.pin_memory().to(source.device, non_blocking=True)
        weights_t = weights_t.pin_memory().to(source.device, non_blocking=True)
    total = None
    for tap in range(taps):
        term = source.index_select(dim, indices[tap]).to(torch.int64) * weights_t[tap].view(shape)
        total = term if total is None else total.add_(term)
    total += 1 << (PRECISION_BITS - 1)
    return (total >> PRECISION_BITS).clamp_(0, 255).to(torch.uint8)


def crop_line_range(in_size: int, out_size: int, start: int, count: int) -> tuple[int, int]:
    """The input lines [low, high) that output lines ``start`` to ``start + count`` read."""
    first, weights = aa_coefficients(in_size, out_size, start, count)
    return int(first.min()), int((first + (weights > 0).sum(axis=1)).max())


def centre_crop_lines_into(image: np.ndarray, out: np.ndarray, new_h: int, new_w: int) -> None:
    """``Resize`` to ``new_h x new_w`` then ``CenterCrop``, computing only the crop's lines, with
    PIL's pixels: PIL (and torch's kernel) resizes horizontally, then vertically, rounding to uint8
    between. The long axis's pass keeps only the crop's lines (``aa_lines``, PIL's arithmetic); the
    short axis's pass is torch's kernel, on only the lines the crop needs."""
    size = out.shape[0]
    height, width = image.shape[:2]
    top, left = centre_crop_offsets(new_h, new_w, size)
    if new_w > new_h:  # wide: the crop's columns, then torch's vertical pass
        first, weights = aa_coefficients(width, new_w, left, size)
        columns = aa_lines(torch.from_numpy(image), 1, first, weights).numpy()
        resize_aa_into(columns, out)
        return
    low, high = crop_line_range(height, new_h, top, size)  # tall: the rows the crop reads
    rows = np.empty((high - low, size, image.shape[2]), np.uint8)
    resize_aa_into(image[low:high], rows)  # horizontal only: torch's kernel
    first, weights = aa_coefficients(height, new_h, top, size)
    np.copyto(out, aa_lines(torch.from_numpy(rows), 0, first - low, weights).numpy())


def resize_aa(image: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Antialiased bilinear resize of a 3xHxW uint8 image, as torchvision's tensor ``resize``:
    the exact uint8 kernel on the CPU; elsewhere in float32, rounded back, as torchvision does
    (a level of rounding from PIL's result at most)."""
    batch = image.unsqueeze(0)
    if image.device.type == "cpu":
        return torch.nn.functional.interpolate(batch, size=size, mode="bilinear", antialias=True)[0]
    resized = torch.nn.functional.interpolate(batch.float(), size=size, mode="bilinear", antialias=True)[0]
    return resized.round_().clamp_(0, 255).to(torch.uint8)


def centre_crop_region(height: int, width: int, size: int) -> tuple[int, int, int, int]:
    """The source pixels (top, left, height, width) that ``Resize(size)`` + ``CenterCrop(size)`` of a
    ``height x width`` image reads: the whole short axis, and along the long one only the lines
    the crop's output lines take taps from (``crop_line_range``). A GPU decode of this region
    alone (``centre_crop_of_region``) gives the whole image's result."""
    new_h, new_w = resized_shape(height, width, size)
    top, left = centre_crop_offsets(new_h, new_w, size)
    if new_w > new_h:
        low, high = crop_line_range(width, new_w, left, size)
        return 0, low, height, high - low
    if new_h > new_w:
        low, high = crop_line_range(height, new_h, top, size)
        return low, 0, high - low, width
    return 0, 0, height, width


def centre_crop_of_region(image: torch.Tensor, origin: tuple[int, int], source: tuple[int, int],
                          size: int) -> torch.Tensor:
    """``Resize(size)`` + ``CenterCrop(size)`` of a ``source`` (height, width) image, from a 3xHxW
    tensor (any device) of its ``centre_crop_region`` whose first pixel is source pixel ``origin``
    (top, left), resizing only the lines the crop keeps, as PIL: the long axis's pass in PIL's
    arithmetic (``aa_lines``), the short axis's through ``resize_aa``, horizontal first."""
    height, width = source
    new_h, new_w = resized_shape(height, width, size)
    top, left = centre_crop_offsets(new_h, new_w, size)
    if new_w > new_h:  # wide: the crop's columns, then the vertical pass
        first, weights = aa_coefficients(width, new_w, left, size)
        return resize_aa(aa_lines(image, 2, first - origin[1], weights), (size, size))
    if new_h > new_w:  # tall: the horizontal pass on the region's rows, then the crop's rows
        rows = resize_aa(image, (int(image.shape[1]), size))
        first, weights = aa_coefficients(height, new_h, top, size)
        return aa_lines(rows, 1, first - origin[0], weights)
    return resize_aa(image, (size, size))
