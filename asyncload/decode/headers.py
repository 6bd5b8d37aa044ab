"""The size an image's header claims, read before any pixel is decoded, for every format the
default decoder's OpenCV reads.

Why hand-written: OpenCV has no call that reads only a header from bytes, and its own pixel limit
(``OPENCV_IO_MAX_IMAGE_PIXELS``, 2**30 by default) is a static read once when cv2 loads, so it
cannot follow a decoder's ``max_pixels`` nor be set reliably from a library. JPEG's header is read
by simplejpeg (libjpeg-turbo); the rest are a few fixed fields each. A reader that cannot find its
fields raises: the decoder's limit cannot be checked, and such a file does not decode anyway.
"""

from __future__ import annotations

import re
import struct
from typing import Iterator, NamedTuple


def _png(data: bytes) -> tuple[int, int]:
    width, height = struct.unpack(">II", data[16:24])  # IHDR, always the first chunk
    return height, width


def _png_chunks_fit(data: bytes) -> None:
    """Raises if a chunk claims more bytes than the file holds. Why: OpenCV's PNG reader
    allocates a chunk's claimed length before it reads it, so a 118-byte file whose second chunk
    claims 2 GB took 2 GB (and a second) to fail, past any ``max_pixels``. A walk over the chunk
    headers up to IEND (one step per chunk: about 1,500 for a 12 MB PNG, 0.5 ms against tens of
    ms to decode it); a file cut inside a chunk header is left to OpenCV (it needs no large buffer)."""
    at = 8
    while at + 8 <= len(data):
        length, kind = struct.unpack_from(">I4s", data, at)
        if at + 12 + length > len(data):
            raise ValueError(f"truncated or corrupt PNG: its {kind.decode('latin-1')!r} chunk at byte {at} claims "
                             f"{length:,} bytes, past the end of the {len(data):,}-byte file")
        if kind == b"IEND":
            return
        at += 12 + length


def _gif(data: bytes) -> tuple[int, int]:
    width, height = struct.unpack("<HH", data[6:10])  # the logical screen: OpenCV's canvas
    return height, width


def _bmp(data: bytes) -> tuple[int, int]:
    if struct.unpack("<I", data[14:18])[0] == 12:  # OS/2 BITMAPCOREHEADER
        width, height = struct.unpack("<HH", data[18:22])
    else:
        width, height = struct.unpack("<ii", data[18:26])  # negative height: rows top-down
    return abs(height), abs(width)


def _webp(data: bytes) -> tuple[int, int]:
    chunk = data[12:16]
    if chunk == b"VP8X":  # extended: the canvas, 24 bits each, minus one
        return int.from_bytes(data[27:30], "little") + 1, int.from_bytes(data[24:27], "little") + 1
    if chunk == b"VP8L":  # lossless: 14 bits each, minus one, after a signature byte
        bits = int.from_bytes(data[21:25], "little")
        return ((bits >> 14) & 0x3FFF) + 1, (bits & 0x3FFF) + 1
    if chunk == b"VP8 ":  # lossy: 14 bits each after the frame tag and start code
        width, height = struct.unpack("<HH", data[26:30])
        return height & 0x3FFF, width & 0x3FFF
    raise ValueError(f"WebP without a VP8/VP8L/VP8X chunk ({chunk!r})")


_TIFF_INTEGERS = {3: "H", 4: "I", 16: "Q"}  # another type for a size: a KeyError, no readable size


def _tiff(data: bytes) -> tuple[int, int]:
    order = "<" if data[:2] == b"II" else ">"
    big = struct.unpack(order + "H", data[2:4])[0] == 43  # BigTIFF: 8-byte offsets and counts
    count_format, entry_format, entry_size = ("Q", "HHQ8s", 20) if big else ("H", "HHI4s", 12)
    offset = struct.unpack(order + ("Q", "I")[not big], data[8:16] if big else data[4:8])[0]
    count = struct.unpack_from(order + count_format, data, offset)[0]
    fields = {}
    start = offset + struct.calcsize(order + count_format)
    for number in range(min(count, 4096)):  # the first page's directory: what OpenCV decodes
        tag, kind, _, value = struct.unpack_from(order + entry_format, data, start + number * entry_size)
        if tag in (256, 257):  # ImageWidth, ImageLength: SHORT (3), LONG (4) or LONG8 (16, BigTIFF)
            fields[tag] = struct.unpack_from(order + _TIFF_INTEGERS[kind], value)[0]
    return fields[257], fields[256]


def _netpbm(data: bytes) -> tuple[int, int]:
    head = re.sub(rb"#[^\n]*", b" ", data[:1024])  # comments hold no fields
    if head[:2] == b"P7":  # PAM: WIDTH and HEIGHT lines before ENDHDR (OpenCV keeps the last: the larger counts)
        lines = [line.split() for line in head[: head.index(b"ENDHDR")].splitlines()]
        width = max(int(line[1]) for line in lines if line[:1] == [b"WIDTH"])
        height = max(int(line[1]) for line in lines if line[:1] == [b"HEIGHT"])
        return height, width
    tokens = head[2:].split()  # P1-P6 and PF/Pf: width height, the first tokens after the magic
    return int(tokens[1]), int(tokens[0])


def _sun_raster(data: bytes) -> tuple[int, int]:
    width, height = struct.unpack(">II", data[4:12])
    return height, width


def _radiance(data: bytes) -> tuple[int, int]:
    # the resolution line right after the header's end (its first empty line), as OpenCV reads it
    end = data.find(b"\n\n", 0, 65536)
    match = re.compile(rb"([-+][YX]) (\d+) ([-+][YX]) (\d+)").match(data, end + 2) if end >= 0 else None
    first, second = int(match.group(2)), int(match.group(4))
    return (first, second) if match.group(1)[1:] == b"Y" else (second, first)


def _jpeg2000(data: bytes) -> tuple[int, int]:
    # Sizes only where the format puts them, as OpenJPEG reads them: a raw codestream's SIZ at its
    # start; in a JP2 file, the SIZ at the start of the first 'jp2c' box's payload and the 'ihdr'
    # box in 'jp2h'. A SIZ searched for anywhere could be a fake one in an earlier box (an 'xml '
    # box), read as 10x10 while the real codestream decodes at 3000x3000. The larger size counts.
    if data[:4] == _SOC_SIZ:
        return _siz(data, 0)
    sizes = []
    for kind, start, end in _boxes(data, 0, len(data)):
        if kind == b"jp2h":
            for inner, at, _ in _boxes(data, start, end):
                if inner == b"ihdr":
                    sizes.append(struct.unpack(">II", data[at : at + 8]))  # HEIGHT, WIDTH
        elif kind == b"jp2c":
            if data[start : start + 4] != _SOC_SIZ:
                raise ValueError("jp2c box not starting with a SIZ segment")
            sizes.append(_siz(data, start))
            return max(height for height, _ in sizes), max(width for _, width in sizes)
    raise ValueError("no jp2c box")  # OpenJPEG decodes the first codestream: none here


_SOC_SIZ = b"\xff\x4f\xff\x51"  # start of codestream, then the image and tile size segment


def _siz(data: bytes, at: int) -> tuple[int, int]:
    width, height, left, top = struct.unpack(">IIII", data[at + 8 : at + 24])  # Xsiz Ysiz XOsiz YOsiz
    return height - top, width - left


def _boxes(data: bytes, start: int, end: int) -> Iterator[tuple[bytes, int, int]]:
    """(type, payload start, payload end) of each ISO/JP2 box from ``start`` to ``end``."""
    while start + 8 <= end:
        length, kind = struct.unpack(">I4s", data[start : start + 8])
        header = 8
        if length == 1:  # a 64-bit length follows
            length, header = struct.unpack(">Q", data[start + 8 : start + 16])[0], 16
        elif length == 0:  # the box runs to the end
            length = end - start
        if length < header:
            raise ValueError(f"box {kind!r} of {length} bytes")
        yield kind, start + header, min(start + length, end)
        start += length


def _avif(data: bytes) -> tuple[int, int]:
    # every image spatial extent ('ispe') property: the largest stands for the whole decode
    sizes = [struct.unpack(">II", data[at + 8 : at + 16]) for at in _all(data, b"ispe")]
    width, height = max(sizes, key=lambda size: size[0] * size[1])
    return height, width


def _all(data: bytes, needle: bytes) -> list[int]:
    found, at = [], data.find(needle)
    while at >= 0:
        found.append(at)
        at = data.find(needle, at + 1)
    return found


class Header(NamedTuple):
    """What a header says: the size, and what its OpenCV decoder holds at its peak per pixel
    (measured on 3000x3000 images with ``IMREAD_COLOR_RGB``: the image and the one it is
    converted from, 6 bytes, for most; float or int32 planes for the heavier ones)."""

    height: int
    width: int
    bytes_per_pixel: float


_READERS = (  # (test on the first bytes, reader, peak bytes a pixel)
    (lambda head: head[:8] == b"\x89PNG\r\n\x1a\n", _png, 6.0),
    (lambda head: head[:6] in (b"GIF87a", b"GIF89a"), _gif, 12.0),
    (lambda head: head[:2] == b"BM", _bmp, 6.0),
    (lambda head: head[:4] == b"RIFF" and head[8:12] == b"WEBP", _webp, 7.0),
    (lambda head: head[:4] in (b"II*\0", b"MM\0*", b"II+\0", b"MM\0+"), _tiff, 6.0),
    (lambda head: head[:2] in (b"PF", b"Pf"), _netpbm, 15.0),  # PFM: float32
    (lambda head: head[:1] == b"P" and head[1:2] in b"1234567" and head[1:2] != b"", _netpbm, 6.0),
    (lambda head: head[:4] == b"\x59\xa6\x6a\x95", _sun_raster, 6.0),
    (lambda head: head[:2] == b"#?", _radiance, 15.0),  # float32
    (lambda head: head[:4] == b"\xff\x4f\xff\x51" or head[4:8] == b"jP  ", _jpeg2000, 10.0),  # int32 planes
    (lambda head: head[4:8] == b"ftyp" and head[8:12] in (b"avif", b"avis"), _avif, 16.0),
)


def header_size(data: bytes) -> Header | None:
    """The size in the header of a non-JPEG image OpenCV reads; None if the bytes are no format
    known here. Raises ``ValueError`` if the format is known but its size fields are not there (a
    truncated or corrupt header, or a PNG chunk longer than the file)."""
    if not isinstance(data, (bytes, bytearray)):
        data = bytes(data)  # find and regular expressions need bytes (the loader reads bytes)
    head = data[:16]
    for matches, reader, bytes_per_pixel in _READERS:
        if matches(head):
            try:
                size = reader(data)
            except (struct.error, AttributeError, IndexError, KeyError, ValueError) as error:
                raise ValueError(f"{reader.__name__[1:]} header without a readable size: {error}") from None
            if reader is _png:
                _png_chunks_fit(data)
            return Header(*size, bytes_per_pixel)
    return None
