"""The decode budget: an image's header is checked before any pixel is decoded, so that a
decompression bomb (a 545-byte JPEG whose header claims 65500x65500, a 130 KB PNG of 32768x32768
zero rows) fails alone with a clear error instead of taking gigabytes, and decodes that are large
but allowed take turns past a shared amount of memory, whatever the number of threads.

The limit is in pixels, as Pillow's (``DecompressionBombError`` past ``2 * Image.MAX_IMAGE_PIXELS``),
of what is decoded: a JPEG decoded at a reduced DCT scale counts its reduced size, so a large
baseline JPEG passes when the reduction brings it under the limit. But libjpeg-turbo keeps a
whole-image buffer of DCT coefficients (2 bytes a sample, whatever the scale) for a progressive JPEG,
or one whose first scan does not hold every component; measured: 192 MB for a 64 M-pixel
progressive 4:2:0 JPEG decoded at 1/8 (3 bytes a pixel), 385 MB at 4:4:4, against 4 MB baseline.
So such a JPEG's full size must be within the limit. OpenCV's decoders hold 6 bytes a pixel at
their peak (PNG, BMP, TIFF, PNM: the RGB image and the BGR one it comes from), more for a few
(``headers.Header.bytes_per_pixel``): those count that many sixths of a pixel per pixel, so that
every format's largest allowed decode takes about 6 bytes x ``max_pixels`` (1.07 GB by default).
"""

from __future__ import annotations

import math
import threading
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Iterator

from .headers import header_size

DEFAULT_MAX_PIXELS = 178_956_970  # Pillow's error threshold, 2 * Image.MAX_IMAGE_PIXELS (~179 M)
# Past this many bytes a decode takes its share of LARGE_DECODES; below it, it goes straight on
# (a 500x375 JPEG takes 0.6 MB: the fast path pays one comparison).
GATED_BYTES = 64 << 20
WORKING_BYTES = 6.0  # what OpenCV's common decoders hold a pixel at their peak: one pixel of the limit
_SAMPLES = {"444": 3.0, "422": 2.0, "440": 2.0, "420": 1.5, "411": 1.5, "441": 1.5}  # a pixel's samples


class ImageTooLarge(ValueError):
    """An image whose decode would take more than the decoder's ``max_pixels``."""

    def __init__(self, height: int, width: int, max_pixels: int, needed: float, detail: str = "") -> None:
        super().__init__(  # short: a SampleError shows at most 200 characters of it
            f"image of {width}x{height} pixels{detail}: counts {needed / 1e6:,.1f} M pixels, over the decode "
            f"limit max_pixels={max_pixels:,} (raise it on the decoder, or max_pixels=None)"
        )
        self.height, self.width, self.max_pixels = height, width, max_pixels
        self._arguments = (height, width, max_pixels, needed, detail)

    def __reduce__(self) -> tuple[type, tuple]:
        return ImageTooLarge, self._arguments  # pickled whole, to and from child processes


def checked_size(data: bytes, max_pixels: int | None) -> tuple[int, int, float] | None:
    """(height, width, the bytes its decode holds at its peak) of a non-JPEG image from its
    header, checked against ``max_pixels`` (``ImageTooLarge``); None for a format whose header is
    not read here when there is no limit. With a limit, such a format is refused: its decode
    could not be bounded."""
    if len(data) == 0:
        raise ValueError("empty file: no image data")
    header = header_size(data)
    if header is None:
        if max_pixels is None:
            return None
        raise ValueError(
            f"not an image whose size can be checked before decoding ({len(data)} bytes, starting "
            f"{bytes(data[:8])!r}): the decoder reads JPEG, PNG, GIF, BMP, WebP, TIFF, PNM/PAM/PFM, Sun "
            "raster, Radiance HDR, JPEG 2000 and AVIF headers; max_pixels=None decodes any format "
            "OpenCV reads, without a limit")
    height, width, bytes_per_pixel = header
    needed = height * width * max(1.0, bytes_per_pixel / WORKING_BYTES)
    if max_pixels is not None and needed > max_pixels:
        detail = f" (its decoder holds {bytes_per_pixel:.0f} bytes a pixel)" if bytes_per_pixel > WORKING_BYTES else ""
        raise ImageTooLarge(height, width, max_pixels, needed, detail)
    return height, width, height * width * max(bytes_per_pixel, WORKING_BYTES)


def held(nbytes: float) -> AbstractContextManager[None]:
    """The share of ``LARGE_DECODES`` a decode of ``nbytes`` holds while it runs: none below
    ``GATED_BYTES``."""
    return LARGE_DECODES.hold(nbytes) if nbytes > GATED_BYTES else _NO_HOLD


def jpeg_buffered_bytes(data: bytes, height: int, width: int, colourspace: str, subsampling: str) -> float:
    """The whole-image coefficient buffer libjpeg-turbo allocates for this JPEG: none for a
    single-scan JPEG, 2 bytes a sample otherwise."""
    if not _whole_image_buffer(data):
        return 0.0
    samples = 4.0 if colourspace in ("CMYK", "YCCK") else 1.0 if colourspace == "Gray" else _SAMPLES.get(subsampling, 3.0)
    return height * width * samples * 2


def jpeg_reduction(data: bytes, header: tuple[int, int, str, str], max_pixels: int | None) -> tuple[int, float]:
    """The smallest DCT reduction (1, 2, 4 or 8) whose decoded size fits ``max_pixels``, and the
    coefficient buffer's bytes; raises ``ImageTooLarge`` if none fits, or if the JPEG keeps its
    coefficients whole and its full size does not fit."""
    height, width = header[:2]
    buffered = jpeg_buffered_bytes(data, *header)
    if max_pixels is None:
        return 1, buffered
    if buffered and height * width > max_pixels:
        detail = " (progressive or multi-scan JPEG: whole at any scale)"
        raise ImageTooLarge(height, width, max_pixels, height * width, detail)
    for reduce in (1, 2, 4, 8):
        if math.ceil(height / reduce) * math.ceil(width / reduce) <= max_pixels:
            return reduce, buffered
        if reduce * 2 > min(height, width):  # a thinner reduced image would lose its short side
            break
    raise ImageTooLarge(height, width, max_pixels, math.ceil(height / reduce) * math.ceil(width / reduce),
                        " (JPEG, at its smallest DCT scale)")


def _whole_image_buffer(data: bytes) -> bool:
    """Whether libjpeg's decoder needs a whole-image coefficient buffer: a progressive frame, or a
    first scan with fewer components than the frame. A header that cannot be walked counts as one."""
    at, components = 2, 0
    while at + 4 <= len(data):
        if data[at] != 0xFF:
            return True
        marker = data[at + 1]
        if marker == 0xFF:  # fill byte
            at += 1
            continue
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):  # a start of frame
            if marker in (0xC2, 0xC6, 0xCA, 0xCE):  # progressive
                return True
            components = data[at + 9] if at + 9 < len(data) else 0
        elif marker == 0xDA:  # the first start of scan
            return at + 4 >= len(data) or data[at + 4] < components
        at += 2 + int.from_bytes(data[at + 2 : at + 4], "big")
    return True


class MemoryGate:
    """Bytes that large decodes may hold at once, across the decode threads of a process: a decode
    over ``GATED_BYTES`` waits for its share, so sixteen threads that meet sixteen large (but
    allowed) images take turns instead of holding sixteen of them at once. A share larger than the
    whole waits for all of it: such an image decodes alone."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.free = capacity
        self._changed = threading.Condition()

    @contextmanager
    def hold(self, nbytes: float) -> Iterator[None]:
        share = min(int(nbytes), self.capacity)
        with self._changed:
            self._changed.wait_for(lambda: self.free >= share)
            self.free -= share
        try:
            yield
        finally:
            with self._changed:
                self.free += share
                self._changed.notify_all()


LARGE_DECODES = MemoryGate(3 << 29)  # 1.5 GiB per process: an image at the default limit and a half
_NO_HOLD = nullcontext()
