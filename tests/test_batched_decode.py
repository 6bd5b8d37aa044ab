"""A batched decoder (``GpuImageDecoder``) as the loader's ``decode``: one ``decode_batch`` per
batch, the same samples, order and pixels as ``ImageDecoder`` row by row, failures through the
same policy. On the CPU, through nvImageCodec's CPU backend; the CUDA test needs a GPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from asyncload import AsyncLoader, ImageDecoder, SampleError, image_folder, list_files, tar_shards, write_shards
from tests.conftest import asyncload_threads
from tests.photos import encoded, mean_abs_diff

nvimgcodec = pytest.importorskip("asyncload.decode.nvimgcodec")
if not nvimgcodec.available():
    pytest.skip("nvImageCodec does not import", allow_module_level=True)

from asyncload.decode.gpu import GpuImageDecoder  # noqa: E402

SIZE = 80  # below an 8x shrink of every photo: ImageDecoder never decodes at a reduced DCT scale, so pixels are equal
FILES = {  # sorted as image_folder lists them; the CPU path takes the PNGs, the WebP and the CMYK JPEG
    "a/0.jpg": ("china", "jpeg_q90_420"), "a/1.jpg": ("flower", "jpeg_progressive"),
    "a/2.jpg": ("grace_hopper", "jpeg_greyscale"), "a/3.png": ("china", "png_rgba"),
    "b/0.jpg": ("grace_hopper", "jpeg_q90_420"), "b/1.jpg": ("china", "jpeg_444"), "b/2.jpg": ("flower", "jpeg_cmyk"),
    "c/0.webp": ("grace_hopper", "webp"), "c/1.jpg": ("china", "jpeg_progressive"), "c/2.png": ("flower", "png_palette"),
}
ON_CPU = 4


def write_folder(root: Path, first_broken: bytes | None = None) -> Path:
    """``FILES`` under ``root``; with ``first_broken``, that file at position 1 of the 12 and a
    text file named .jpg at position 9."""
    for name, (photo, variant) in FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(encoded(photo, variant))
    if first_broken is not None:
        (root / "a/0b.jpg").write_bytes(first_broken)
        (root / "c/0b.jpg").write_bytes(b"not an image, named .jpg")
    return root


@pytest.fixture(scope="module")
def photo_folder(tmp_path_factory) -> Path:
    return write_folder(tmp_path_factory.mktemp("photos"))


@pytest.fixture(scope="module")
def broken_folder(tmp_path_factory) -> Path:
    """A truncated JPEG at position 1: the batch decode rejects it, then the CPU path."""
    good = encoded("china", "jpeg_q90_420")
    return write_folder(tmp_path_factory.mktemp("broken"), first_broken=good[: len(good) // 2])


@pytest.fixture(scope="module")
def unreadable_folder(tmp_path_factory) -> Path:
    """A JPEG header libjpeg cannot parse at position 1: it goes straight to the CPU path (on a
    GPU, whether nvJPEG rejects a truncated JPEG as libjpeg-turbo does is its own question)."""
    return write_folder(tmp_path_factory.mktemp("unreadable"), first_broken=b"\xff\xd8\xff not a JPEG")


class RecordingDecoder(GpuImageDecoder):
    """The real decoder (nvImageCodec's CPU backend), noting the rows of each ``decode_batch``
    call; every row on the "GPU" unless ``split`` says otherwise."""

    def __init__(self, *args, split="gpu", **kwargs) -> None:
        super().__init__(*args, device="cpu", split=split, **kwargs)
        self.calls: list[list[int]] = []
        self.cpu_calls: list[list[int]] = []

    def decode_batch(self, datas, keys, out, stream=None, rows=None, cpu_share=False):
        (self.cpu_calls if cpu_share else self.calls).append(list(rows))
        return super().decode_batch(datas, keys, out, stream=stream, rows=rows, cpu_share=cpu_share)

    def rows_per_call(self) -> list[list[int]]:
        """The rows of each call, sorted (reads finish in any order), the calls sorted too."""
        return sorted(sorted(rows) for rows in self.calls)


def run_epoch(source, decode, **kwargs) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], AsyncLoader]:
    kwargs = {"batch_size": 4, "seed": 3, "num_threads": 2, **kwargs}
    with AsyncLoader(source, decode=decode, **kwargs) as loader:
        return [(images.clone(), labels.clone()) for images, labels in loader], loader


def assert_pixels(images: torch.Tensor, expected: np.ndarray, train: bool) -> bool:
    """train: the box decoded alone, the same kernel: equal; eval: the centre crop's lines in
    PIL's arithmetic against torch's kernel on the whole image: a level apart at most."""
    difference = np.abs(images.numpy().astype(int) - expected)
    assert difference.max() <= (0 if train else 1) and difference.mean() < 0.01
    return True


def expected_batches(source, positions: list[list[int]], order: np.ndarray, train: bool) -> list[np.ndarray]:
    """ImageDecoder's images of the samples at ``positions`` of ``order``, with the keys the
    per-row path gives them: ``(epoch, source index)``."""
    reference = ImageDecoder(SIZE, train=train, seed=5)
    batches = []
    for batch in positions:
        indices = [int(order[p]) for p in batch]
        batches.append(np.stack([reference(Path(source[i][0]).read_bytes(), key=(0, i)) for i in indices]))
    return batches


@pytest.mark.parametrize("train", [True, False])
def test_the_seeded_samples_in_order_with_image_decoder_s_pixels(photo_folder, train):
    source = image_folder(str(photo_folder))
    decoder = RecordingDecoder(SIZE, train=train, seed=5)
    batches, loader = run_epoch(source, decoder)
    order = loader.sampler.order(0)
    assert [len(labels) for _, labels in batches] == [4, 4, 2]
    expected = expected_batches(source, [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]], order, train)
    for (images, labels), images_expected, start in zip(batches, expected, (0, 4, 8)):
        assert_pixels(images, images_expected, train)
        assert labels.tolist() == [source[int(i)][1] for i in order[start:start + len(labels)]]
    assert decoder.rows_per_call() == [[0, 1], [0, 1, 2, 3], [0, 1, 2, 3]]  # one call per batch
    figures = loader.stats.as_dict()
    assert (figures["decode/items"], figures["read/items"], figures["decoded_on_cpu"], figures["failures"]) == (10, 10, ON_CPU, 0)
    # and the per-row loader gives the same batches
    row_by_row, _ = run_epoch(source, ImageDecoder(SIZE, train=train, seed=5))
    for (images, labels), (images_row, labels_row) in zip(batches, row_by_row, strict=True):
        assert_pixels(images, images_row.numpy(), train)
        assert torch.equal(labels, labels_row)


def test_a_broken_file_raises_sample_error_naming_it_at_decode(broken_folder):
    source = image_folder(str(broken_folder))
    with AsyncLoader(source, batch_size=4, shuffle=False, decode=RecordingDecoder(SIZE)) as loader:
        with pytest.raises(SampleError) as raised:
            list(loader)
    assert raised.value.item == str(broken_folder / "a/0b.jpg") == source[1][0]
    assert raised.value.stage == "decode"


class MisnumberingDecoder(RecordingDecoder):
    """Reports its first row failed under the row's number in the batch, not its position in
    ``datas``: a contract breach the loader must turn into errors, not a batch never complete."""

    def decode_batch(self, datas, keys, out, stream=None, rows=None, cpu_share=False):
        result = super().decode_batch(datas, keys, out, stream=stream, rows=rows)
        return result._replace(failures={rows[0] + 100: ValueError("misnumbered")})


class RaisingDecoder(RecordingDecoder):
    def decode_batch(self, datas, keys, out, stream=None, rows=None, cpu_share=False):
        raise RuntimeError("the device went away")


@pytest.mark.parametrize("decoder, cause", [(MisnumberingDecoder, "TypeError: its failures must be a dict keyed"),
                                            (RaisingDecoder, "RuntimeError: the device went away")])
def test_a_batch_decode_that_breaks_fails_its_rows_saying_so(photo_folder, decoder, cause):
    source = image_folder(str(photo_folder))
    with AsyncLoader(source, batch_size=4, shuffle=False, decode=decoder(SIZE)) as loader:
        with pytest.raises(SampleError, match=f"decode_batch of 4 rows failed: {cause}") as raised:
            list(loader)
    assert raised.value.item == source[0][0] and raised.value.stage == "decode"


@pytest.mark.parametrize("folder", ["broken_folder", "unreadable_folder"])
def test_skip_refills_the_failed_row_and_delivers_every_good_sample_once(request, folder):
    source = image_folder(str(request.getfixturevalue(folder)))
    decoder = RecordingDecoder(SIZE, train=True, seed=5)
    # prefetch=1: batch 0 (and its refill) completes before batch 1 takes its positions
    kwargs = dict(shuffle=False, on_error="skip", max_failures=2, prefetch=1)
    batches, loader = run_epoch(source, decoder, **kwargs)
    # position 1 fails: its row takes position 4; position 9 fails with nothing left to take its
    # row, so the last row (position 11) moves into it
    positions = [[0, 4, 2, 3], [5, 6, 7, 8], [11, 10]]
    expected = expected_batches(source, positions, np.arange(len(source)), train=True)
    for (images, labels), images_expected, batch in zip(batches, expected, positions, strict=True):
        np.testing.assert_array_equal(images.numpy(), images_expected)
        assert labels.tolist() == [source[p][1] for p in batch]
    assert decoder.rows_per_call() == [[0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3], [1]]  # row 1 refilled alone
    assert [(f.item, f.stage) for f in loader.stats.failures] == [(source[1][0], "decode"), (source[9][0], "decode")]
    assert loader.stats.as_dict()["failures"] == 2
    row_by_row, _ = run_epoch(source, ImageDecoder(SIZE, train=True, seed=5), **kwargs)
    for (images, labels), (images_row, labels_row) in zip(batches, row_by_row, strict=True):
        assert torch.equal(images, images_row) and torch.equal(labels, labels_row)


def _memory_source(folder: Path) -> list[tuple[str, int]]:
    import fsspec

    fs = fsspec.filesystem("memory")
    items = []
    for url, label in image_folder(str(folder)):
        name = Path(url).relative_to(folder).as_posix()
        fs.pipe_file(f"/asyncload-batched/{name}", Path(url).read_bytes())
        items.append((f"memory://asyncload-batched/{name}", label))
    return items


async def _read_file(path: str) -> bytes:
    return Path(path).read_bytes()


@pytest.mark.parametrize("where", ["read=", "memory://", "tar shards"])
def test_bytes_from_anywhere_decode_as_from_files(photo_folder, tmp_path, where):
    source, kwargs = image_folder(str(photo_folder)), {}
    if where == "read=":
        kwargs = {"read": _read_file}
    elif where == "memory://":
        source = _memory_source(photo_folder)
    else:
        write_shards(source, str(tmp_path), samples_per_shard=3)
        source = tar_shards(str(tmp_path))
    decoder = RecordingDecoder(SIZE, train=True, seed=5)
    batches, loader = run_epoch(source, decoder, **kwargs)
    row_by_row, _ = run_epoch(source, ImageDecoder(SIZE, train=True, seed=5), **kwargs)
    assert [len(labels) for _, labels in batches] == [4, 4, 2]
    for (images, labels), (images_row, labels_row) in zip(batches, row_by_row, strict=True):
        assert torch.equal(images, images_row) and torch.equal(labels, labels_row)
    assert decoder.rows_per_call() == [[0, 1], [0, 1, 2, 3], [0, 1, 2, 3]]
    assert loader.stats.as_dict()["decoded_on_cpu"] == ON_CPU
    if where == "memory://":
        import fsspec

        fsspec.filesystem("memory").rm("/asyncload-batched", recursive=True)


@pytest.mark.parametrize("extra", [{"processes": 2}, {"isolate": True}])
def test_a_batched_decoder_runs_in_process_only(photo_folder, extra):
    with pytest.raises(ValueError, match="runs in-process"):
        AsyncLoader(image_folder(str(photo_folder)), decode=RecordingDecoder(SIZE), **extra)


def test_a_cuda_decoder_needs_the_loader_on_its_device(photo_folder):
    with pytest.raises(ValueError, match=r"device=None: pass device='cuda'"):
        AsyncLoader(image_folder(str(photo_folder)), decode=GpuImageDecoder(SIZE))  # its device is "cuda"


def test_items_without_labels_give_the_images_alone(photo_folder):
    source = list_files(str(photo_folder))
    with AsyncLoader(source, batch_size=4, shuffle=False, decode=RecordingDecoder(SIZE)) as loader:
        batches = [images.clone() for images in loader]
    expected = expected_batches([(url, None) for url in source], [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]],
                                np.arange(len(source)), train=False)
    for images, images_expected in zip(batches, expected, strict=True):
        assert_pixels(images, images_expected, train=False)


def test_leaving_early_leaves_no_thread(photo_folder):
    before = set(asyncload_threads())
    loader = AsyncLoader(image_folder(str(photo_folder)), batch_size=2, decode=RecordingDecoder(SIZE), num_threads=2)
    for images, labels in loader:
        assert images.shape == (2, SIZE, SIZE, 3)
        break
    loader.close()
    assert [t.name for t in asyncload_threads() if t not in before] == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("broken", [False, True])
def test_on_cuda_batches_stay_on_the_gpu_within_a_level_of_the_cpu_path(photo_folder, unreadable_folder, broken):
    source = image_folder(str(unreadable_folder if broken else photo_folder))
    kwargs = dict(shuffle=False, prefetch=1, on_error="skip", max_failures=2)  # broken: a refill and a hole, as above
    on_gpu, loader = run_epoch(source, GpuImageDecoder(SIZE, train=True, seed=5, device="cuda"), device="cuda", **kwargs)
    assert all(images.is_cuda and labels.is_cuda for images, labels in on_gpu)
    on_cpu, _ = run_epoch(source, ImageDecoder(SIZE, train=True, seed=5), **kwargs)
    torch.cuda.synchronize()
    assert len(on_gpu) == len(on_cpu)
    for (images, labels), (images_cpu, labels_cpu) in zip(on_gpu, on_cpu):  # kept batches stay intact
        assert torch.equal(labels.cpu(), labels_cpu)
        for image, image_cpu in zip(images.cpu().numpy(), images_cpu.numpy()):
            assert mean_abs_diff(image, image_cpu) < 1.5  # nvJPEG's IDCT and a float resize
    assert loader.stats.as_dict()["decoded_on_cpu"] == ON_CPU + (2 if broken else 0)  # the CPU path fails both
