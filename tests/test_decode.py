import cv2
import numpy as np
import pytest
import simplejpeg

from asyncload.decode.image import ImageDecoder, centre_square_box, decode_rgb, random_resized_crop_box


def gradient_image(height: int, width: int) -> np.ndarray:
    """Smooth content with a different value at every position, so crops and flips show."""
    y, x = np.mgrid[0:height, 0:width]
    return np.stack([x * 255 // width, y * 255 // height, (x + y) * 127 // (width + height)], -1).astype(np.uint8)


def png(image_rgb: np.ndarray) -> bytes:
    return cv2.imencode(".png", cv2.cvtColor(image_rgb, cv2.COLOR_RGB2BGR))[1].tobytes()


def test_eval_transform_is_torchvision_resize_then_centre_crop():
    from PIL import Image

    image = gradient_image(60, 100)
    out = ImageDecoder(size=30)(png(image))
    # Resize(30): 60x100 -> 30x50 (PIL's antialiased bilinear), CenterCrop(30): columns 10..40
    expected = np.asarray(Image.fromarray(image).resize((50, 30), Image.BILINEAR))[:, 10:40]
    assert out.shape == (30, 30, 3) and out.dtype == np.uint8
    assert np.abs(out.astype(int) - expected).max() <= 1


def test_fast_eval_transform_is_centre_square_resized_by_opencv():
    image = gradient_image(60, 100)
    out = ImageDecoder(size=30, antialias=False)(png(image))
    np.testing.assert_array_equal(out, cv2.resize(image[:, 20:80], (30, 30), interpolation=cv2.INTER_LINEAR))


def test_decode_writes_into_the_given_row():
    batch = np.zeros((3, 16, 16, 3), dtype=np.uint8)
    ImageDecoder(size=16).decode_into(png(np.full((20, 20, 3), 200, np.uint8)), batch[1])
    assert (batch[1] == 200).all()
    assert not batch[0].any() and not batch[2].any()


@pytest.mark.parametrize("antialias", [True, False])
def test_large_jpeg_uses_dct_downscale_and_stays_close_to_full_decode(antialias):
    image = gradient_image(800, 1000)
    data = simplejpeg.encode_jpeg(image, quality=95)
    out = ImageDecoder(size=100, antialias=antialias)(data)
    full = simplejpeg.decode_jpeg(data)
    reference = cv2.resize(full[:, 100:900], (100, 100), interpolation=cv2.INTER_AREA)
    assert np.abs(out.astype(int) - reference).mean() < 2.0
    # the downscaled decode the decoder asks for is at most half size
    small = simplejpeg.decode_jpeg(data, min_height=100, min_width=125)
    assert small.shape[0] <= 400


def test_train_transform_repeats_for_the_same_key_and_varies_otherwise():
    data = simplejpeg.encode_jpeg(gradient_image(120, 160), quality=95)
    decoder = ImageDecoder(size=32, train=True, seed=3)
    first = decoder(data, key=(0, 7))
    np.testing.assert_array_equal(first, decoder(data, key=(0, 7)))
    others = [decoder(data, key=(epoch, 7)) for epoch in range(1, 6)]
    assert all(not np.array_equal(first, other) for other in others)
    assert not np.array_equal(first, ImageDecoder(size=32, train=True, seed=4)(data, key=(0, 7)))


def test_train_transform_flips_about_half_the_time():
    image = gradient_image(64, 64)
    decoder = ImageDecoder(size=64, train=True, scale=(1.0, 1.0), ratio=(1.0, 1.0))
    data = png(image)
    flipped = sum(bool(decoder(data, key=(0, i))[0, 0, 0] > decoder(data, key=(0, i))[0, -1, 0]) for i in range(200))
    assert 70 < flipped < 130
    no_flip = ImageDecoder(size=64, train=True, scale=(1.0, 1.0), ratio=(1.0, 1.0), flip=False)
    np.testing.assert_array_equal(no_flip(data, key=(0, 1)), image)


def test_random_resized_crop_box_stays_inside_and_in_range():
    rng = np.random.default_rng(0)
    for _ in range(500):
        top, left, h, w = random_resized_crop_box(375, 500, rng)
        assert 0 <= top and 0 <= left and top + h <= 375 and left + w <= 500
        assert 0.08 * 375 * 500 * 0.9 <= h * w <= 375 * 500
        assert 3 / 4 * 0.9 <= w / h <= 4 / 3 * 1.1


def test_random_resized_crop_falls_back_to_centre_crop_for_extreme_shapes():
    # a 10x1000 strip: no random try fits the ratio range, so the centre crop clamps the ratio
    assert random_resized_crop_box(10, 1000, np.random.default_rng(0), scale=(0.9, 1.0)) == (0, 493, 10, 13)


def test_centre_square_box():
    assert centre_square_box(375, 500) == (0, 62, 375, 375)
    assert centre_square_box(500, 375) == (62, 0, 375, 375)


def test_greyscale_jpeg_becomes_rgb():
    grey = np.full((40, 40, 1), 90, dtype=np.uint8)
    out = ImageDecoder(size=20)(simplejpeg.encode_jpeg(grey, colorspace="GRAY", quality=95))
    assert out.shape == (20, 20, 3)
    assert np.abs(out.astype(int) - 90).max() <= 2


def test_png_with_alpha_becomes_rgb():
    rgba = np.zeros((30, 30, 4), dtype=np.uint8)
    rgba[..., 0], rgba[..., 3] = 255, 128
    data = cv2.imencode(".png", cv2.cvtColor(rgba, cv2.COLOR_RGBA2BGRA))[1].tobytes()
    out = ImageDecoder(size=10)(data)
    assert out.shape == (10, 10, 3) and (out[..., 0] == 255).all() and not out[..., 1:].any()


def test_bytes_that_are_no_image_raise_a_clear_error():
    with pytest.raises(ValueError, match="not an image OpenCV can decode"):
        decode_rgb(b"hello, world")


@pytest.mark.parametrize("size", [16, 4])  # 4: decoded at a reduced DCT scale
@pytest.mark.parametrize("antialias", [True, False])
def test_truncated_jpeg_is_an_error_not_a_grey_image(antialias, size):
    data = simplejpeg.encode_jpeg(gradient_image(64, 64), quality=90)
    with pytest.raises(ValueError):
        ImageDecoder(size=size, antialias=antialias)(data[: len(data) // 2])


def test_empty_file_is_a_clear_error():
    with pytest.raises(ValueError, match="empty file"):
        ImageDecoder(size=16)(b"")


@pytest.mark.parametrize("extension", [".png", ".webp", ".bmp"])
def test_other_formats_are_detected_from_their_bytes_not_their_name(extension):
    image = np.zeros((40, 50, 3), np.uint8)
    image[..., 0] = 200  # red
    data = cv2.imencode(extension, cv2.cvtColor(image, cv2.COLOR_RGB2BGR))[1].tobytes()
    out = ImageDecoder(size=16)(data)
    assert abs(int(out[..., 0].mean()) - 200) <= 2 and out[..., 1:].max() <= 2


def test_cmyk_jpeg_becomes_rgb():
    # Pure red (C=0, M=Y=255, K=0) stored inverted, as Adobe writes CMYK JPEGs.
    cmyk = np.zeros((16, 16, 4), np.uint8)
    cmyk[..., 0], cmyk[..., 1], cmyk[..., 2], cmyk[..., 3] = 255, 0, 0, 255  # inverted CMYK
    data = simplejpeg.encode_jpeg(cmyk, colorspace="CMYK", quality=95)
    assert simplejpeg.decode_jpeg_header(data)[2] in ("CMYK", "YCCK")
    out = ImageDecoder(size=8)(data)
    assert out.shape == (8, 8, 3)
    assert out[..., 0].min() > 200 and out[..., 1:].max() < 60


@pytest.mark.parametrize("shape", [(1, 1), (1, 500), (3000, 4000), (10000, 10000)])
def test_tiny_and_large_images_decode(shape):
    data = simplejpeg.encode_jpeg(np.full((*shape, 3), 128, np.uint8), quality=90)
    for train in (False, True):
        out = ImageDecoder(size=32, train=train)(data, key=(0, 1))
        assert out.shape == (32, 32, 3) and abs(int(out.mean()) - 128) <= 3


# Fuzzing: whatever the bytes, the decoder returns a well-formed image or raises an exception.
# A crash in native code would take the whole test process down with it.
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_SEED_JPEG = simplejpeg.encode_jpeg(gradient_image(48, 64), quality=80)
_SEED_PNG = png(gradient_image(24, 32))


def _decode_or_raise(data: bytes) -> None:
    for train, antialias in ((False, True), (True, True), (False, False), (True, False)):
        try:
            out = ImageDecoder(size=16, train=train, antialias=antialias)(data, key=(0, 0))
        except Exception:
            continue
        assert out.shape == (16, 16, 3) and out.dtype == np.uint8


def test_a_png_chunk_claiming_more_than_the_file_is_refused_before_opencv_allocates_it():
    """OpenCV's PNG reader allocates a chunk's claimed length before reading it: a 118-byte PNG
    whose second chunk claims 2 GB took 2 GB of memory to fail (whatever ``max_pixels``), and such
    examples made test_fuzz_corrupted_images take 30 s. It fails on its header now, naming the
    chunk; a whole PNG with bytes after its IEND still decodes."""
    data = bytearray(_SEED_PNG)
    data[33] = 0x7F  # the length of the chunk after IHDR (8 + 25 bytes): 2,130,706,432 and more
    with pytest.raises(ValueError, match=r"truncated or corrupt PNG: its 'IDAT' chunk at byte 33 claims 2,13"):
        ImageDecoder(size=16)(bytes(data[:118]), key=(0, 0))
    with pytest.raises(ValueError, match=r"truncated or corrupt PNG: its 'IDAT' chunk at byte 33 claims \d"):
        ImageDecoder(size=16, max_pixels=None)(_SEED_PNG[:100], key=(0, 0))
    assert ImageDecoder(size=16)(_SEED_PNG + b"trailing", key=(0, 0)).shape == (16, 16, 3)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=2048))
def test_fuzz_arbitrary_bytes(data):
    _decode_or_raise(data)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([_SEED_JPEG, _SEED_PNG]), st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=8),
       st.integers(0, 10**6))
def test_fuzz_corrupted_images(seed, flips, cut):
    data = bytearray(seed)
    for position, value in flips:
        data[position % len(data)] = value
    _decode_or_raise(bytes(data[: max(1, cut % (len(data) + 1))]))


# Hostile headers (issue 32): whatever size a header claims, the decode raises or returns a
# well-formed image, within the limit (a small one here, so that no example allocates much).
from tests.hostile import bmp_rle_bomb, gif_bomb, jpeg_claiming, png_bomb, thin_jpeg  # noqa: E402

_SMALL_LIMIT = 2_000_000
_PNG_64 = png_bomb(64)


def _claiming(kind: str, height: int, width: int) -> bytes:
    import struct
    import zlib

    if kind in ("progressive", "baseline"):
        return jpeg_claiming(height, width, progressive=kind == "progressive")
    if kind == "png":  # 64x64 zero rows under a header claiming another size
        body = b"IHDR" + struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
        return _PNG_64[:12] + body + struct.pack(">I", zlib.crc32(body)) + _PNG_64[33:]
    if kind == "bmp":
        return bmp_rle_bomb(height, width)
    return gif_bomb(min(height, width))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["progressive", "baseline", "png", "bmp", "gif"]), st.integers(1, 65535), st.integers(1, 65535))
def test_fuzz_claimed_sizes(kind, height, width):
    data = _claiming(kind, height, width)
    for train, antialias in ((False, True), (True, True), (False, False), (True, False)):
        try:
            out = ImageDecoder(size=16, train=train, antialias=antialias, max_pixels=_SMALL_LIMIT)(data, key=(0, 0))
        except ValueError as error:  # ImageTooLarge, a header libjpeg rejects, a small claim's missing data
            assert "memory" not in str(error).lower(), error  # never an allocation failure
            continue
        assert out.shape == (16, 16, 3) and out.dtype == np.uint8


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 4), st.integers(1, 30000), st.booleans(), st.booleans(), st.booleans())
def test_fuzz_thin_images(short, long, tall, train, antialias):
    data = thin_jpeg(long, short) if tall else thin_jpeg(short, long)
    out = ImageDecoder(size=32, train=train, antialias=antialias)(data, key=(0, 3))
    assert out.shape == (32, 32, 3) and out.dtype == np.uint8
