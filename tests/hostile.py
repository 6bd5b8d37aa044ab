"""Hostile images for the decode budget's tests, made here from a few bytes each: files whose
header claims far more pixels than they hold (decompression bombs), and thin images."""

from __future__ import annotations

import functools
import struct
import zlib

import cv2
import numpy as np
import simplejpeg


def _sof_offset(data: bytes) -> int:
    """Where a JPEG's start-of-frame segment begins (its 0xFF)."""
    at = 2
    while not (0xC0 <= data[at + 1] <= 0xCF and data[at + 1] not in (0xC4, 0xC8, 0xCC)):
        at += 2 + int.from_bytes(data[at + 2 : at + 4], "big")
    return at


def jpeg_claiming(height: int, width: int, progressive: bool = True) -> bytes:
    """A 16x16 JPEG whose frame header is patched to claim ``height x width``."""
    flags = [cv2.IMWRITE_JPEG_PROGRESSIVE, int(progressive), cv2.IMWRITE_JPEG_QUALITY, 50]
    data = bytearray(cv2.imencode(".jpg", np.full((16, 16, 3), 90, np.uint8), flags)[1].tobytes())
    at = _sof_offset(bytes(data))
    data[at + 5 : at + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


@functools.lru_cache(maxsize=None)
def png_bomb(side: int = 32768) -> bytes:
    """A valid 1-bit greyscale PNG of ``side x side`` zero pixels: ~130 KB at 32768."""
    row = b"\0" * (1 + (side + 7) // 8)  # filter byte, then the row's bits
    compressor = zlib.compressobj(9)
    chunks = [min(256, side - start) for start in range(0, side, 256)]  # 256 rows at a time
    idat = b"".join(compressor.compress(row * rows) for rows in chunks) + compressor.flush()
    header = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header) + _png_chunk(b"IDAT", idat) + _png_chunk(b"IEND", b"")


def bmp_rle_bomb(height: int = 32768, width: int = 32768) -> bytes:
    """An 8-bit run-length BMP of ``height x width`` whose pixel data ends at once: ~1 KB."""
    palette = bytes(range(256)) * 4
    pixels = b"\x00\x01"  # end of bitmap
    offset = 14 + 40 + len(palette)
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 8, 1, len(pixels), 2835, 2835, 256, 0)
    return b"BM" + struct.pack("<IHHI", offset + len(pixels), 0, 0, offset) + info + palette + pixels


def gif_bomb(side: int = 65535) -> bytes:
    """A GIF whose screen and single frame are ``side x side``, with a few bytes of LZW data."""
    screen = b"GIF89a" + struct.pack("<HHBBB", side, side, 0x80, 0, 0) + b"\0\0\0\xff\xff\xff"
    frame = b"\x2c" + struct.pack("<HHHHB", 0, 0, side, side, 0) + b"\x02\x02\x44\x01\x00"
    return screen + frame + b"\x3b"


def gif_frame_bomb() -> bytes:
    """A 16x16 GIF whose one frame claims 65535x65535: the header's screen is small, the frame
    is not (OpenCV refuses a frame outside the screen before allocating it)."""
    screen = b"GIF89a" + struct.pack("<HHBBB", 16, 16, 0x80, 0, 0) + b"\0\0\0\xff\xff\xff"
    frame = b"\x2c" + struct.pack("<HHHHB", 0, 0, 65535, 65535, 0) + b"\x02\x02\x44\x01\x00"
    return screen + frame + b"\x3b"


def webp_bomb() -> bytes:
    """A lossless WebP whose header claims 16384x16384 (VP8L's largest)."""
    data = bytearray(cv2.imencode(".webp", np.zeros((8, 8, 3), np.uint8), [cv2.IMWRITE_WEBP_QUALITY, 101])[1].tobytes())
    assert data[12:16] == b"VP8L"
    bits = int.from_bytes(data[21:25], "little")
    bits = (bits & ~0xFFFFFFF) | (16383 << 14) | 16383
    data[21:25] = bits.to_bytes(4, "little")
    return bytes(data)


def tiff_bomb(side: int = 65535) -> bytes:
    """An uncompressed TIFF whose first directory claims ``side x side``."""
    data = bytearray(cv2.imencode(".tiff", np.zeros((8, 8, 3), np.uint8), [cv2.IMWRITE_TIFF_COMPRESSION, 1])[1].tobytes())
    order = "<" if data[:2] == b"II" else ">"
    offset = struct.unpack(order + "I", data[4:8])[0]
    count = struct.unpack_from(order + "H", data, offset)[0]
    for number in range(count):
        at = offset + 2 + 12 * number
        tag, kind = struct.unpack_from(order + "HH", data, at)
        if tag in (256, 257):
            struct.pack_into(order + ("H" if kind == 3 else "I"), data, at + 8, side)
    return bytes(data)


BOMBS = {  # name -> (bytes, the size its header claims, height x width)
    "progressive_jpeg": (lambda: jpeg_claiming(65500, 65500), (65500, 65500)),
    "png_1bit": (png_bomb, (32768, 32768)),
    "bmp_rle": (bmp_rle_bomb, (32768, 32768)),
    "gif": (gif_bomb, (65535, 65535)),
    "webp_lossless": (webp_bomb, (16384, 16384)),
    "tiff": (tiff_bomb, (65535, 65535)),
}


def thin_jpeg(height: int = 1, width: int = 20000) -> bytes:
    """A real JPEG of a thin strip (a gradient): 5.6 KB at 1 x 20000."""
    strip = np.linspace(0, 255, width, dtype=np.uint8)[None, :, None].repeat(height, 0).repeat(3, 2)
    return simplejpeg.encode_jpeg(np.ascontiguousarray(strip), quality=90)


def bomb_cases() -> dict:
    """For ``tests.bounded``: every bomb through the default decoder, eval and train."""
    from asyncload.decode.image import ImageDecoder

    ImageDecoder()(thin_jpeg(64, 64))  # warm: the steady state includes the decoder's first use
    cases = {}
    for name, (make, _) in BOMBS.items():
        data = make()
        cases[name] = functools.partial(ImageDecoder(), data)
        cases[name + "_train_fast"] = functools.partial(ImageDecoder(train=True, antialias=False), data, key=(0, 1))
    cases["gif_frame_outside_its_screen"] = functools.partial(ImageDecoder(), gif_frame_bomb())
    return cases


def thin_cases() -> dict:
    """For ``tests.bounded``: a 20000x1 and a 1x20000 JPEG in every mode of the decoder."""
    from asyncload.decode.image import ImageDecoder

    ImageDecoder()(thin_jpeg(64, 64))
    cases = {}
    for height, width in ((1, 20000), (20000, 1)):
        data = thin_jpeg(height, width)
        for train in (False, True):
            for antialias in (True, False):
                name = f"{height}x{width}_{'train' if train else 'eval'}_{'aa' if antialias else 'fast'}"
                cases[name] = functools.partial(ImageDecoder(train=train, antialias=antialias), data, key=(0, 1))
    return cases


def large_cases() -> dict:
    """For ``tests.bounded``: four PNGs of 90 M pixels (under the default limit: each decodes to
    270 MB, and takes ~465 MB at its peak), for four threads at once."""
    from asyncload.decode.image import ImageDecoder

    ImageDecoder()(thin_jpeg(64, 64))
    data = png_bomb(9500)
    return {f"png_{number}": functools.partial(ImageDecoder(), data) for number in range(4)}
