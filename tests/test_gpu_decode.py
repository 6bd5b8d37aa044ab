"""GpuImageDecoder: the batching, boxes and CPU fallback run here on the CPU (torchvision's batched
decode where it imports, else simplejpeg's, in the same place); nvJPEG itself needs CUDA."""

import numpy as np
import pytest
import simplejpeg
import torch

from asyncload.decode.image import ImageDecoder
from asyncload.decode.gpu import GpuImageDecoder, jpeg_decode_on_cpu, torchvision_decode_jpegs
from tests.photos import encoded, mean_abs_diff, reference_crop

MIXED = [  # what a folder of user files holds: nvJPEG takes the first four
    ("china", "jpeg_q90_420"), ("flower", "jpeg_progressive"), ("grace_hopper", "jpeg_greyscale"),
    ("china", "jpeg_444"), ("flower", "jpeg_cmyk"), ("grace_hopper", "png_palette"), ("china", "webp"),
    ("flower", "bmp"), ("grace_hopper", "jpeg_q90_420"),
]


def _torchvision_works() -> bool:
    try:  # a torchvision built for another torch raises RuntimeError on import
        import torchvision.io  # noqa: F401
    except Exception:
        return False
    return True


BATCH_DECODERS = [
    pytest.param(jpeg_decode_on_cpu, id="simplejpeg"),
    pytest.param(torchvision_decode_jpegs, id="torchvision",
                 marks=pytest.mark.skipif(not _torchvision_works(), reason="torchvision does not import")),
]
cuda = pytest.mark.skipif(not (torch.cuda.is_available() and _torchvision_works()), reason="needs CUDA and torchvision")


def test_split_sends_what_nvjpeg_cannot_decode_to_the_cpu():
    datas = [encoded(photo, variant) for photo, variant in MIXED] + [b"", b"\xff\xd8\xff junk"]
    gpu_rows, cpu_rows, pixels = GpuImageDecoder.split_sized(datas, None)
    assert gpu_rows == [0, 1, 2, 3, 8]
    assert cpu_rows == [4, 5, 6, 7, 9, 10]
    assert set(pixels) <= set(range(len(datas))) and set(gpu_rows) <= set(pixels)


def test_a_truncated_jpeg_goes_to_the_strict_cpu_path_which_rejects_it():
    """nvJPEG may decode a truncated file's first rows without an error, as libjpeg does unless
    strict: a JPEG that does not end with its EOI marker is the CPU path's, and fails there."""
    whole = encoded("china", "jpeg_q90_420")
    truncated = whole[: len(whole) * 2 // 3]
    padded = whole + b"\0" * 8  # zeros after EOI, as some writers leave: still whole
    gpu_rows, cpu_rows, _ = GpuImageDecoder.split_sized([whole, truncated, padded], None)
    assert gpu_rows == [0, 2] and cpu_rows == [1]
    decoder = GpuImageDecoder(32, device="cpu", decode_jpegs=jpeg_decode_on_cpu)
    out = torch.zeros((2, 32, 32, 3), dtype=torch.uint8)
    failures, _, on_cpu = decoder.decode_batch([whole, truncated], [None, None], out)
    assert on_cpu == [1] and list(failures) == [1], "decoded on the CPU, where it fails"


def test_a_dict_in_a_batch_fails_its_row_alone_saying_to_pass_members():
    """A sample of columns (MDS, litdata) given to the batched decoder fails its own row, with
    ImageDecoder's message, not the batch with a TypeError from slicing a dict."""
    whole = encoded("china", "jpeg_q90_420")
    decoder = GpuImageDecoder(32, device="cpu", decode_jpegs=jpeg_decode_on_cpu)
    out = torch.zeros((2, 32, 32, 3), dtype=torch.uint8)
    failures, _, on_cpu = decoder.decode_batch([whole, {"image": whole, "label": 1}], [None, None], out)
    assert on_cpu == [1] and list(failures) == [1]
    assert str(failures[1]) == ("ImageDecoder got a dict ('image', 'label'), not an image's bytes: pass "
                                'decode=Members("image", "label", image=ImageDecoder(...))')


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("decode_jpegs", BATCH_DECODERS)
def test_batch_equals_image_decoder_row_by_row(decode_jpegs, train):
    datas = [encoded(photo, variant) for photo, variant in MIXED]
    keys = [(3, index) for index in range(len(datas))]
    out = torch.zeros((len(datas), 224, 224, 3), dtype=torch.uint8)
    result = GpuImageDecoder(224, train=train, seed=7, device="cpu", decode_jpegs=decode_jpegs).decode_batch(datas, keys, out)
    assert result.failures == {} and result.event is None and result.on_cpu == [4, 5, 6, 7]
    cpu = ImageDecoder(224, train=train, seed=7)
    for row, (data, key) in enumerate(zip(datas, keys)):
        # same boxes, same flips, same uint8 kernel: the same pixels
        np.testing.assert_array_equal(out[row].numpy(), cpu(data, key=key))


@pytest.mark.parametrize("decode_jpegs", BATCH_DECODERS)
def test_a_file_the_batch_decode_rejects_goes_to_the_cpu_and_is_reported_alone(decode_jpegs):
    good = encoded("china", "jpeg_q90_420")
    truncated = good[: len(good) // 2]
    datas = [good, truncated, encoded("flower", "png_rgba"), good]
    out = torch.full((4, 64, 64, 3), 7, dtype=torch.uint8)
    result = GpuImageDecoder(64, device="cpu", decode_jpegs=decode_jpegs).decode_batch(datas, [None] * 4, out)
    assert list(result.failures) == [1] and isinstance(result.failures[1], ValueError)
    assert result.on_cpu == [1, 2]  # the batch call failed; the good JPEGs were retried alone
    assert (out[1] == 7).all()  # a failed row is left as it was, for the loader to refill
    reference = ImageDecoder(64)
    for row in (0, 2, 3):
        np.testing.assert_array_equal(out[row].numpy(), reference(datas[row]))


@cuda
@pytest.mark.parametrize("train", [False, True])
def test_nvjpeg_matches_the_cpu_path_within_a_level(train):
    datas = [encoded(photo, variant) for photo, variant in MIXED]
    keys = [(0, index) for index in range(len(datas))]
    out = torch.zeros((len(datas), 224, 224, 3), dtype=torch.uint8, device="cuda")
    result = GpuImageDecoder(224, train=train).decode_batch(datas, keys, out)
    torch.cuda.current_stream().wait_event(result.event)
    assert result.failures == {}
    cpu = ImageDecoder(224, train=train)
    for row, (data, key) in enumerate(zip(datas, keys)):
        difference = np.abs(out[row].cpu().numpy().astype(int) - cpu(data, key=key))
        # nvJPEG's IDCT and upsampling, and a float resize, against libjpeg-turbo and uint8
        assert difference.mean() < 1.5, MIXED[row]


@cuda
def test_decode_on_a_side_stream_is_ordered_by_its_event():
    datas = [encoded("china", "jpeg_q90_420"), encoded("flower", "jpeg_cmyk")] * 32
    out = torch.zeros((len(datas), 224, 224, 3), dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    expected = ImageDecoder(224)(datas[0]).astype(np.float64).mean()
    for _ in range(3):
        out.zero_()
        side.wait_stream(torch.cuda.current_stream())  # the zeroing happens first
        result = GpuImageDecoder(224).decode_batch(datas, [None] * len(datas), out, stream=side)
        torch.cuda.current_stream().wait_event(result.event)  # the consumer waits, not the host
        means = out.float().mean(dim=(1, 2, 3)).cpu().numpy()
        assert abs(means[0] - expected) < 1 and (means > 0).all()


def test_rows_send_a_refill_to_chosen_rows_only():
    datas = [encoded("flower", "jpeg_q90_420"), encoded("china", "png_rgba")]
    out = torch.zeros((5, 64, 64, 3), dtype=torch.uint8)
    result = GpuImageDecoder(64, train=True, device="cpu", decode_jpegs=jpeg_decode_on_cpu).decode_batch(
        datas, [(0, 10), (0, 11)], out, rows=[3, 1])
    assert result.failures == {} and result.on_cpu == [1]  # numbered as datas
    cpu = ImageDecoder(64, train=True)
    np.testing.assert_array_equal(out[3].numpy(), cpu(datas[0], key=(0, 10)))
    np.testing.assert_array_equal(out[1].numpy(), cpu(datas[1], key=(0, 11)))
    assert not out[[0, 2, 4]].any()


def test_past_an_8x_shrink_the_boxes_are_the_cpu_path_s_and_the_pixels_within_a_level():
    # the CPU path decodes at 1/2 scale here and snaps its box to even pixels; the batch decode
    # is full size but crops the same snapped box
    data = encoded("china", "jpeg_q90_420")
    keys = [(2, index) for index in range(8)]
    out = torch.zeros((8, 24, 24, 3), dtype=torch.uint8)
    decoder = GpuImageDecoder(24, train=True, scale=(0.5, 1.0), device="cpu", decode_jpegs=jpeg_decode_on_cpu)
    decoder.decode_batch([data] * 8, keys, out)
    cpu = ImageDecoder(24, train=True, scale=(0.5, 1.0))
    reductions = set()
    for row, key in enumerate(keys):
        plan = cpu.plan(427, 640, cpu.rng(key))
        reductions.add(plan.reduce)
        expected = reference_crop(data, plan.box, 24, plan.flip)
        assert np.abs(out[row].numpy().astype(int) - expected).max() <= 1  # full decode: exact
        assert mean_abs_diff(cpu(data, key=key), expected) < 1.5  # DCT-scaled decode: close
    assert 2 in reductions


# The decode budget (issue 32): nvJPEG decodes at full size, so the limit is checked before it.
from asyncload.decode.budget import ImageTooLarge  # noqa: E402
from asyncload.decode.gpu import chunks  # noqa: E402
from tests.hostile import jpeg_claiming, thin_jpeg  # noqa: E402


def _large_baseline_jpeg() -> bytes:
    y, x = np.mgrid[0:2000, 0:2000]
    image = np.stack([x * 255 // 2000, y * 255 // 2000, (x + y) * 127 // 2000], -1).astype(np.uint8)
    return simplejpeg.encode_jpeg(image, quality=90)


def test_a_jpeg_over_the_limit_goes_to_the_cpu_which_reduces_it_or_fails_it_alone():
    good = encoded("china", "jpeg_q90_420")
    bomb = jpeg_claiming(65500, 65500)  # progressive: refused at any scale
    large = _large_baseline_jpeg()  # 4 M pixels: over 1 M at full size, 250 k at 1/4
    datas = [good, bomb, large, good]
    assert GpuImageDecoder.split_sized(datas, max_pixels=1_000_000)[:2] == ([0, 3], [1, 2])
    assert GpuImageDecoder.split_sized(datas, None)[:2] == ([0, 1, 2, 3], [])  # no limit: a valid header goes to nvJPEG
    out = torch.full((4, 64, 64, 3), 7, dtype=torch.uint8)
    decoder = GpuImageDecoder(64, device="cpu", decode_jpegs=jpeg_decode_on_cpu, max_pixels=1_000_000)
    result = decoder.decode_batch(datas, [None] * 4, out)
    assert list(result.failures) == [1] and isinstance(result.failures[1], ImageTooLarge)
    assert "65500x65500" in str(result.failures[1]) and result.on_cpu == [1, 2]
    assert (out[1] == 7).all()
    cpu = ImageDecoder(64, max_pixels=1_000_000)
    for row in (0, 2, 3):
        np.testing.assert_array_equal(out[row].numpy(), cpu(datas[row]))


def test_one_nvjpeg_call_decodes_at_most_max_pixels():
    calls = []

    def recording(datas, device):
        calls.append(len(datas))
        return jpeg_decode_on_cpu(datas, device)

    datas = [encoded("china", "jpeg_q90_420")] * 5  # 427x640 = 273 k pixels each
    out = torch.zeros((5, 32, 32, 3), dtype=torch.uint8)
    GpuImageDecoder(32, device="cpu", decode_jpegs=recording, max_pixels=600_000).decode_batch(datas, [None] * 5, out)
    assert calls == [2, 2, 1]
    assert chunks([0, 1, 2, 3], {0: 5, 1: 5, 2: 20, 3: 1}, 10) == [[0, 1], [2], [3]]
    assert chunks([0, 1], {0: 5, 1: 5}, None) == [[0, 1]] and chunks([], {}, 10) == []


def test_an_out_of_memory_on_the_gpu_sends_that_image_alone_to_the_cpu():
    """A CUDA out-of-memory fails the whole batched call: the images are retried alone, and the
    one that fails again is decoded on the CPU; one that fails in the resize goes there too."""
    large = _large_baseline_jpeg()

    def out_of_memory_on_large(datas, device):
        if any(data.numel() == len(large) for data in datas):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 11.45 GiB")
        return jpeg_decode_on_cpu(datas, device)

    datas = [encoded("china", "jpeg_q90_420"), large, encoded("flower", "jpeg_progressive")]
    out = torch.zeros((3, 64, 64, 3), dtype=torch.uint8)
    decoder = GpuImageDecoder(64, device="cpu", decode_jpegs=out_of_memory_on_large)
    result = decoder.decode_batch(datas, [None] * 3, out)
    assert result.failures == {} and result.on_cpu == [1]
    cpu = ImageDecoder(64)
    for row in range(3):
        np.testing.assert_array_equal(out[row].numpy(), cpu(datas[row]))

    transform, calls = decoder.transform, []

    def fails_once(image, plan):
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (resize)")
        return transform(image, plan)

    decoder.transform = fails_once
    out.zero_()
    result = decoder.decode_batch(datas[::2], [None] * 2, out)
    assert result.failures == {} and result.on_cpu == [0]
    np.testing.assert_array_equal(out[0].numpy(), cpu(datas[0]))


@pytest.mark.parametrize("shape", [(3, 4000), (4000, 3)])
def test_a_thin_image_s_eval_resizes_only_the_crop_on_the_device_too(shape):
    data = thin_jpeg(*shape)
    out = torch.zeros((1, 224, 224, 3), dtype=torch.uint8)
    result = GpuImageDecoder(224, device="cpu", decode_jpegs=jpeg_decode_on_cpu).decode_batch([data], [None], out)
    assert result.failures == {} and result.on_cpu == []
    np.testing.assert_array_equal(out[0].numpy(), ImageDecoder(224)(data))
