"""The default decode gives torchvision's pixels on real photos, in every encoding tested."""

import os
from pathlib import Path

import numpy as np
import pytest

from asyncload.decode.image import ImageDecoder, dct_reduction, snap_box
from asyncload.decode.resize import centre_crop_offsets, resized_shape
from tests.photos import VARIANTS, encoded, mean_abs_diff, photos, reference_crop, reference_eval

PHOTOS = ["china", "flower", "grace_hopper"]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("photo", PHOTOS)
def test_eval_equals_torchvision_resize_and_centre_crop(photo, variant):
    data = encoded(photo, variant)
    out = ImageDecoder(224)(data)
    reference = reference_eval(data, 224)
    # the same filter in the same fixed-point arithmetic: a level of rounding at most, and one
    # more where libjpeg-turbo's CMYK -> RGB rounds otherwise than PIL's (0.98 levels mean)
    assert np.abs(out.astype(int) - reference).max() <= _tolerance(variant)
    assert mean_abs_diff(out, reference) < (1.2 if variant == "jpeg_cmyk" else 0.1)


def _tolerance(variant: str) -> int:
    return 2 if variant == "jpeg_cmyk" else 1


@pytest.mark.parametrize("variant", ["jpeg_q90_420", "jpeg_cmyk", "png_palette", "webp"])
@pytest.mark.parametrize("photo", PHOTOS)
def test_train_equals_torchvision_resized_crop_and_flip(photo, variant):
    data = encoded(photo, variant)
    decoder = ImageDecoder(224, train=True, seed=5)
    height, width = photos()[photo].shape[:2]
    flips = 0
    for index in range(6):
        plan = decoder.plan(height, width, decoder.rng((1, index)))
        assert plan.reduce == 1  # no crop of a 640-pixel photo is 8x the target
        flips += plan.flip
        out = decoder(data, key=(1, index))
        reference = reference_crop(data, plan.box, 224, plan.flip)
        assert np.abs(out.astype(int) - reference).max() <= _tolerance(variant)
    assert 0 < flips < 6


def test_the_fast_option_is_opencv_bilinear_and_several_levels_off():
    import cv2

    data = encoded("china", "jpeg_q90_420")
    fast = ImageDecoder(224, antialias=False)(data)
    image = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR_RGB)
    np.testing.assert_array_equal(fast, cv2.resize(image[:, 106:533], (224, 224), interpolation=cv2.INTER_LINEAR))
    assert mean_abs_diff(fast, reference_eval(data, 224)) > 5


@pytest.mark.parametrize("photo", PHOTOS)
def test_dct_reduction_past_an_8x_shrink_stays_within_a_level_or_two(photo):
    data = encoded(photo, "jpeg_q90_420")
    height, width = photos()[photo].shape[:2]
    decoder = ImageDecoder(48)
    assert decoder.plan(height, width, decoder.rng(None)).reduce == 2  # 427 >= 8 * 48
    assert mean_abs_diff(decoder(data), reference_eval(data, 48)) < 1.5
    train = ImageDecoder(32, train=True, scale=(0.9, 1.0))
    for index in range(3):
        plan = train.plan(height, width, train.rng((0, index)))
        assert plan.reduce == 2 and all(value % 2 == 0 for value in plan.box)
        assert mean_abs_diff(train(data, key=(0, index)), reference_crop(data, plan.box, 32, plan.flip)) < 1.5


def test_dct_reduction_waits_for_a_4x_shrink_after_it():
    assert dct_reduction(447, 56) == 1  # 1/2 scale would leave a 3.99x shrink
    assert dct_reduction(448, 56) == 2
    assert dct_reduction(3000, 224) == 2
    assert dct_reduction(7168, 224) == 8
    assert dct_reduction(10**6, 224) == 8


def test_snap_box_moves_the_crop_to_whole_reduced_pixels_inside_the_image():
    assert snap_box((3, 5, 801, 799), 1, 1000, 1000) == (3, 5, 801, 799)
    assert snap_box((3, 5, 801, 799), 4, 1000, 1000) == (4, 4, 800, 800)
    assert snap_box((10, 995, 401, 7), 8, 1003, 1003) == (8, 992, 400, 8)  # kept inside 125 blocks
    assert snap_box((0, 0, 1003, 1003), 8, 1003, 1003) == (0, 0, 1000, 1000)


def test_resized_shape_and_centre_crop_are_torchvision_s():
    assert resized_shape(427, 640, 224) == (224, 335)  # int(224 * 640 / 427) = int(335.7)
    assert resized_shape(600, 512, 224) == (262, 224)
    assert centre_crop_offsets(224, 335, 224) == (0, 56)  # round(55.5): Python rounds half to even
    assert centre_crop_offsets(262, 224, 224) == (19, 0)


def test_eval_of_an_upscaled_tiny_image_matches_torchvision():
    data = encoded("china", "png_palette")
    small = ImageDecoder(16)(data)
    big = ImageDecoder(700)(data)  # upscale: plain bilinear, as PIL
    assert np.abs(small.astype(int) - reference_eval(data, 16)).max() <= 1
    assert np.abs(big.astype(int) - reference_eval(data, 700)).max() <= 1


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_the_resize_starts_no_thread_pool_of_its_own():
    # torch starts its intra-op (OpenMP) pool on the first op that splits its work; from many
    # decode threads that would oversubscribe the cores. The uint8 antialiased kernel runs on the
    # calling thread: the process gains no thread, where an elementwise op on a large tensor does.
    import subprocess
    import sys

    script = """
import os, numpy as np, torch
from asyncload.decode.resize import resize_aa_into, resize_centre_crop_into
torch.set_num_threads(4)
count = lambda: len(os.listdir("/proc/self/task"))
before = count()
image = np.random.default_rng(0).integers(0, 256, (2000, 3000, 3), dtype=np.uint8)
resize_aa_into(image[100:1900, 200:2800], np.empty((224, 224, 3), np.uint8))
resize_centre_crop_into(image, np.empty((224, 224, 3), np.uint8))
after_resize = count()
torch.ones(4000, 4000).add_(1)
print(before, after_resize, count())
"""
    root = Path(__file__).resolve().parent.parent
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True, cwd=root)
    before, after_resize, after_elementwise = map(int, result.stdout.split())
    assert after_resize == before
    assert after_elementwise > before  # the count does see a pool when one starts


@pytest.mark.parametrize("rows", [1, 3, 20, 150])  # aspect ratios 640:1 to 4.3:1
@pytest.mark.parametrize("tall", [False, True])
@pytest.mark.parametrize("size", [224, 40])
def test_eval_of_a_thin_strip_resizes_only_the_crop_and_still_equals_torchvision(rows, tall, size):
    """Past a 4:1 aspect ratio eval resizes only the lines the centre crop keeps (a 20000x1 image
    would otherwise need a 224 x 4,480,000 intermediate): the long axis in PIL's own arithmetic,
    the short one by torch's kernel, so the pixels stay torchvision's."""
    from PIL import Image

    strip = photos()["china"][200 : 200 + rows]
    strip = np.ascontiguousarray(strip.transpose(1, 0, 2) if tall else strip)
    buffer = __import__("io").BytesIO()
    Image.fromarray(strip).save(buffer, "PNG")
    data = buffer.getvalue()
    out = ImageDecoder(size)(data)
    reference = reference_eval(data, size)
    assert np.abs(out.astype(int) - reference).max() <= 1
    # 0 on all but 150x640 at 40, where torch's kernel rounds 14% of values a level off PIL's
    # whether it resizes the whole strip or only the crop's rows (0.14 both)
    assert mean_abs_diff(out, reference) < 0.2
