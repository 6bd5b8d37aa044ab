"""The decode budget (issue 32): a header over the pixel limit fails alone with a clear error before
any pixel is decoded; large decodes stay within bounded memory on many threads; thin images decode
without a huge intermediate. Memory is measured in a child process under an address-space limit
(tests/bounded.py), so a regression fails there instead of endangering the machine."""

import io
import pickle
import struct
import threading

import cv2
import numpy as np
import pytest
import simplejpeg

from asyncload import AsyncLoader, ImageDecoder
from asyncload.decode.budget import DEFAULT_MAX_PIXELS, ImageTooLarge, MemoryGate, _whole_image_buffer, jpeg_reduction
from asyncload.decode.headers import header_size
from tests.bounded import run_bounded
from tests.conftest import identify, image_colour, make_jpeg
from tests.hostile import BOMBS, jpeg_claiming, png_bomb

GB = 1 << 30
IMAGE = (np.arange(64 * 96 * 3) % 251).astype(np.uint8).reshape(64, 96, 3)


def _pil(fmt: str, **options) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(IMAGE).save(buffer, fmt, **options)
    return buffer.getvalue()


def _every_format() -> dict:
    cases = {ext: lambda ext=ext: cv2.imencode(ext, IMAGE[..., 0] if ext in (".pgm", ".pbm") else IMAGE)[1].tobytes()
             for ext in (".png", ".gif", ".bmp", ".tiff", ".ppm", ".pgm", ".pbm", ".pam", ".ras", ".jp2", ".avif")}
    cases.update({
        ".hdr": lambda: cv2.imencode(".hdr", IMAGE.astype(np.float32))[1].tobytes(),
        ".pfm": lambda: cv2.imencode(".pfm", IMAGE.astype(np.float32))[1].tobytes(),
        "webp_lossy": lambda: cv2.imencode(".webp", IMAGE, [cv2.IMWRITE_WEBP_QUALITY, 80])[1].tobytes(),
        "webp_lossless": lambda: cv2.imencode(".webp", IMAGE, [cv2.IMWRITE_WEBP_QUALITY, 101])[1].tobytes(),
        "webp_extended": lambda: _pil("WEBP", exif=b"Exif\0\0MM\0*\0\0\0\x08\0\0"),
        "bigtiff": lambda: _pil("TIFF", big_tiff=True),
        "j2k_codestream": lambda: (lambda data: data[data.find(b"\xff\x4f\xff\x51"):])(cv2.imencode(".jp2", IMAGE)[1].tobytes()),
    })
    return cases


@pytest.mark.parametrize("name", sorted(_every_format()))
def test_the_header_gives_the_size_opencv_decodes(name):
    data = _every_format()[name]()
    decoded = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR_RGB)
    assert decoded is not None and decoded.shape[:2] == (64, 96)
    assert header_size(data)[:2] == (64, 96)
    assert ImageDecoder(16)(data).shape == (16, 16, 3)  # and the decoder takes it under its limit


@pytest.mark.parametrize("mode", ["eval", "train", "fast"])
@pytest.mark.parametrize("name", sorted(BOMBS))
def test_a_bomb_fails_alone_naming_its_size_the_limit_and_how_to_raise_it(name, mode):
    make, (height, width) = BOMBS[name]
    decoder = ImageDecoder(train=mode == "train", antialias=mode != "fast")
    with pytest.raises(ImageTooLarge, match=f"{width}x{height} pixels") as caught:
        decoder(make(), key=(0, 1))
    assert "max_pixels=178,956,970" in str(caught.value) and "max_pixels=None" in str(caught.value)
    assert isinstance(caught.value, ValueError)  # bad input, as a corrupt file is
    assert str(pickle.loads(pickle.dumps(caught.value))) == str(caught.value)  # crosses processes


def test_bombs_fail_clearly_within_bounded_memory_on_two_threads():
    """Each bomb in eval and train, two at a time, in a child allowed 2 GB over its steady state:
    the clear error, never an allocation failure (on main: MemoryError, cv2 'Insufficient memory',
    libjpeg 'Insufficient memory', and the WebP decoded at 805 MB)."""
    outcomes = run_bounded(2 * GB, "tests.hostile:bomb_cases", threads=2)
    growth = int(outcomes.pop("peak_rss_growth_mb"))
    assert len(outcomes) == 2 * len(BOMBS) + 1
    assert outcomes.pop("gif_frame_outside_its_screen").startswith("ValueError: not an image OpenCV can decode")
    for case, outcome in outcomes.items():
        assert outcome.startswith("ImageTooLarge: image of"), (case, outcome)
    assert growth < 100, growth


def test_a_baseline_jpeg_bomb_is_allowed_at_the_scale_that_fits():
    """A baseline 65500x65500 header is 67 M pixels at 1/8 scale, under the default limit: it is
    decoded there (and fails on its missing data); a progressive one is refused (above)."""
    data = jpeg_claiming(65500, 65500, progressive=False)
    assert jpeg_reduction(data, simplejpeg.decode_jpeg_header(data), DEFAULT_MAX_PIXELS) == (8, 0.0)
    with pytest.raises(ImageTooLarge, match="65500x65500 pixels .JPEG, at its smallest DCT scale"):
        jpeg_reduction(data, simplejpeg.decode_jpeg_header(data), 60_000_000)


def test_thin_images_decode_in_every_mode_within_bounded_memory():
    """A 5 KB 20000x1 JPEG (and 1x20000): eval resized the whole long axis, a 224 x 4,480,000
    intermediate (2.8 GB, MemoryError here on main); now only the crop's lines."""
    outcomes = run_bounded(GB, "tests.hostile:thin_cases", threads=2)
    growth = int(outcomes.pop("peak_rss_growth_mb"))
    assert set(outcomes.values()) == {"ok"}, outcomes
    assert growth < 100, growth


def test_large_allowed_decodes_take_turns_on_four_threads():
    """Four 90 M-pixel PNGs (270 MB each decoded, under the limit) on four threads: the memory
    gate lets two through at a time. Without it they take ~1.9 GB at once and fail under this
    child's 1.5 GB (measured by swapping the gate for an unbounded one)."""
    outcomes = run_bounded(3 * GB // 2, "tests.hostile:large_cases", threads=4)
    growth = int(outcomes.pop("peak_rss_growth_mb"))
    assert set(outcomes.values()) == {"ok"}, outcomes
    assert growth < 1600, growth


def test_the_limit_is_adjustable_and_none_removes_it():
    data = cv2.imencode(".png", np.zeros((2000, 1500, 3), np.uint8))[1].tobytes()
    with pytest.raises(ImageTooLarge, match="1500x2000 pixels.*max_pixels=2,999,999"):
        ImageDecoder(16, max_pixels=2_999_999)(data)
    assert ImageDecoder(16, max_pixels=3_000_000)(data).shape == (16, 16, 3)
    assert ImageDecoder(16, max_pixels=None)(data).shape == (16, 16, 3)
    assert ImageDecoder().max_pixels == DEFAULT_MAX_PIXELS == 2 * 89_478_485  # Pillow's, doubled


def test_a_format_whose_decoder_holds_more_counts_more():
    """OpenCV holds 6 bytes a pixel at its peak for PNG (the RGB image and its BGR original), 12
    for GIF: at the same size and limit, the PNG decodes and the GIF counts twice its pixels."""
    image = np.zeros((1000, 1000, 3), np.uint8)
    png, gif = (cv2.imencode(ext, image)[1].tobytes() for ext in (".png", ".gif"))
    assert ImageDecoder(16, max_pixels=1_500_000)(png).shape == (16, 16, 3)
    with pytest.raises(ImageTooLarge, match="holds 12 bytes a pixel.*counts 2.0 M pixels"):
        ImageDecoder(16, max_pixels=1_500_000)(gif)
    assert ImageDecoder(16, max_pixels=2_000_000)(gif).shape == (16, 16, 3)


def _gradient_jpeg(side: int, progressive: bool) -> bytes:
    y, x = np.mgrid[0:side, 0:side]
    image = np.stack([x * 255 // side, y * 255 // side, (x + y) * 127 // side], -1).astype(np.uint8)
    return cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_PROGRESSIVE, int(progressive), cv2.IMWRITE_JPEG_QUALITY, 90])[1].tobytes()


@pytest.mark.parametrize("antialias", [True, False])
def test_a_dct_reduction_brings_a_large_baseline_jpeg_under_the_limit(antialias):
    """2000x2000 (4 M pixels) under a 300 k limit: decoded at 1/4 (250 k pixels), where the crop
    alone would have asked for a full decode; 1/8 is the floor, so 60 k fails."""
    data = _gradient_jpeg(2000, progressive=False)
    decoder = ImageDecoder(224, train=True, scale=(0.08, 0.1), antialias=antialias, max_pixels=300_000)
    assert decoder.plan(2000, 2000, decoder.rng((0, 1)), min_reduce=1).reduce == 1
    out = decoder(data, key=(0, 1))
    unlimited = ImageDecoder(224, train=True, scale=(0.08, 0.1), antialias=antialias, max_pixels=None)(data, key=(0, 1))
    assert np.abs(out.astype(int) - unlimited).mean() < 3  # a smooth gradient: nearly the same crop
    with pytest.raises(ImageTooLarge, match="at its smallest DCT scale"):
        ImageDecoder(32, train=True, antialias=antialias, max_pixels=60_000)(data, key=(0, 1))


def test_a_progressive_jpeg_counts_its_whole_coefficient_buffer():
    """libjpeg-turbo keeps a progressive JPEG's coefficients whole at any scale (measured: 192 MB
    for 64 M pixels at 4:2:0 decoded at 1/8): its full size counts, where a baseline one of the
    same size decodes reduced."""
    baseline, progressive = _gradient_jpeg(2000, False), _gradient_jpeg(2000, True)
    assert ImageDecoder(32, max_pixels=1_000_000)(baseline).shape == (32, 32, 3)
    with pytest.raises(ImageTooLarge, match="progressive or multi-scan"):
        ImageDecoder(32, max_pixels=1_000_000)(progressive)
    # 4:2:0: 1.5 samples a pixel, 2 bytes each: 4 M pixels' worth, plus the 1/8-scale image
    assert ImageDecoder(32, max_pixels=4_100_000)(progressive).shape == (32, 32, 3)


def test_the_whole_image_buffer_is_told_from_the_header():
    baseline = simplejpeg.encode_jpeg(IMAGE, quality=90)
    assert not _whole_image_buffer(baseline)
    assert not _whole_image_buffer(simplejpeg.encode_jpeg(np.ascontiguousarray(IMAGE[..., :1]), colorspace="GRAY"))
    assert _whole_image_buffer(jpeg_claiming(16, 16, progressive=True))
    scan = baseline.find(b"\xff\xda")
    one_component_scan = baseline[: scan + 4] + b"\x01" + baseline[scan + 5 :]  # a non-interleaved first scan
    assert _whole_image_buffer(one_component_scan)
    assert _whole_image_buffer(baseline[:40])  # a header cut before its scan: counted as buffered


def test_a_format_whose_size_cannot_be_read_is_refused_under_a_limit():
    with pytest.raises(ValueError, match="not an image whose size can be checked.*max_pixels=None"):
        ImageDecoder(16)(b"hello, world")
    with pytest.raises(ValueError, match="not an image OpenCV can decode"):
        ImageDecoder(16, max_pixels=None)(b"hello, world")
    with pytest.raises(ValueError, match="png header without a readable size"):
        ImageDecoder(16)(png_bomb(64)[:18])
    with pytest.raises(ValueError, match="empty file"):
        ImageDecoder(16)(b"")


def test_the_memory_gate_lets_shares_through_up_to_its_capacity():
    gate = MemoryGate(10)
    inside, release = threading.Event(), threading.Event()
    order = []

    def hold(name, nbytes, wait=None):
        with gate.hold(nbytes):
            order.append(name)
            if wait:
                inside.set()
                wait.wait(5)

    first = threading.Thread(target=hold, args=("first", 6, release))
    first.start()
    assert inside.wait(5)
    second = threading.Thread(target=hold, args=("second", 6))  # 6 + 6 > 10: waits for the first
    huge = threading.Thread(target=hold, args=("huge", 10**9))  # more than all: waits for all, then alone
    second.start()
    huge.start()
    second.join(0.2)
    assert order == ["first"] and gate.free == 4
    release.set()
    for thread in (first, second, huge):
        thread.join(5)
    assert sorted(order[1:]) == ["huge", "second"] and gate.free == 10


@pytest.mark.parametrize("processes", [0, 2])
def test_the_loader_skips_a_bomb_counts_it_and_delivers_the_rest(tmp_path, processes):
    source = []
    for index in range(6):
        path = tmp_path / f"{index}.jpg"
        path.write_bytes(make_jpeg(image_colour(1, index)))
        source.append((str(path), 1))
    for name in ("progressive_jpeg", "png_1bit"):
        path = tmp_path / f"bomb_{name}"
        path.write_bytes(BOMBS[name][0]())
        source.insert(2, (str(path), 1))
    loader = AsyncLoader(source, batch_size=4, shuffle=False, decode=ImageDecoder(32), on_error="skip",
                         max_failures=2, processes=processes, prefetch=1)
    with loader:
        delivered = [identify(image.numpy()) for images, _ in loader for image in images]
    # each slot of a failed sample takes the epoch's next item, in the order the failures come
    assert sorted(delivered) == [(1, index) for index in range(6)] and len(delivered) == 6
    failures = {str(failure.item).rsplit("/", 1)[-1]: failure for failure in loader.stats.failures}
    assert set(failures) == {"bomb_progressive_jpeg", "bomb_png_1bit"}
    assert all("over the decode limit" in str(failure) for failure in failures.values())


@pytest.mark.parametrize("processes", [0, 2])
def test_without_skip_the_bomb_raises_a_sample_error_naming_it(tmp_path, processes):
    from asyncload import SampleError

    good, bomb = tmp_path / "good.jpg", tmp_path / "bomb.png"
    good.write_bytes(make_jpeg(image_colour(0, 0)))
    bomb.write_bytes(png_bomb())
    loader = AsyncLoader([str(good), str(bomb)], batch_size=2, shuffle=False, decode=ImageDecoder(32), processes=processes)
    with loader, pytest.raises(SampleError) as caught:
        list(loader)
    assert caught.value.item == str(bomb) and caught.value.stage == "decode"
    assert "32768x32768 pixels" in str(caught.value) and "max_pixels=" in str(caught.value)


def _with_box_before_codestream(data: bytes, kind: bytes, payload: bytes) -> bytes:
    codestream = data.index(b"jp2c") - 4  # cv2's JP2: signature, ftyp, jp2h, jp2c, each with a 32-bit length
    return data[:codestream] + struct.pack(">I4s", 8 + len(payload), kind) + payload + data[codestream:]


def _siz(width: int, height: int) -> bytes:
    return b"\xff\x4f\xff\x51" + struct.pack(">HHIIII", 41, 0, width, height, 0, 0)


def test_a_jpeg2000_size_is_read_where_openjpeg_reads_it_not_from_a_fake_siz_before_it():
    """A 10x10 SIZ in an 'xml ' box before the codestream was read as the size, while OpenJPEG
    decodes the real one: the limit was bypassed (a 3000x3000 image under max_pixels=1M)."""
    data = cv2.imencode(".jp2", IMAGE)[1].tobytes()
    faked = _with_box_before_codestream(data, b"xml ", b"<x>" + _siz(10, 10) + b"</x>")
    assert cv2.imdecode(np.frombuffer(faked, np.uint8), cv2.IMREAD_COLOR_RGB).shape[:2] == (64, 96)
    assert header_size(faked)[:2] == (64, 96)
    with pytest.raises(ImageTooLarge, match="96x64 pixels"):
        ImageDecoder(16, max_pixels=1000)(faked)
    # the header box's size counts too, the larger of the two
    ihdr = data.index(b"ihdr") + 4
    taller = data[:ihdr] + struct.pack(">II", 640, 96) + data[ihdr + 8 :]
    assert header_size(taller)[:2] == (640, 96)
    with pytest.raises(ValueError, match="jpeg2000 header without a readable size: no jp2c box"):
        header_size(data[: data.index(b"jp2c") - 4])
    with pytest.raises(ValueError, match="jp2c box not starting with a SIZ"):
        header_size(data.replace(b"jp2c\xff\x4f", b"jp2c\x00\x4f"))


def test_other_headers_take_their_sizes_only_where_the_format_puts_them():
    # PAM: a WIDTH in a comment is no field; a repeated one is the larger (OpenCV keeps the last)
    pam = b"P7\n# WIDTH 10 HEIGHT 10\nWIDTH 3\nHEIGHT 2\nWIDTH 3000\nDEPTH 1\nMAXVAL 255\nTUPLTYPE GRAYSCALE\nENDHDR\n"
    assert header_size(pam + bytes(6000))[:2] == (2, 3000)
    # Radiance: the resolution line right after the header, not one found further on
    hdr = cv2.imencode(".hdr", IMAGE.astype(np.float32))[1].tobytes()
    end = hdr.index(b"\n\n") + 2
    with pytest.raises(ValueError, match="radiance header without a readable size"):
        header_size(hdr[:end] + b"garbage\n\n-Y 1 +X 1\n" + hdr[end:])
    # big-endian BigTIFF with LONG8 (type 16) sizes: the high half was read as the size, 0x0
    entries = b"".join(struct.pack(">HHQQ", tag, 16, 1, 3000) for tag in (256, 257))
    bigtiff = b"MM\0+" + struct.pack(">HHQQ", 8, 0, 16, 2) + entries + struct.pack(">Q", 0)
    assert header_size(bigtiff)[:2] == (3000, 3000)
