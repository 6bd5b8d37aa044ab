"""The GPU decode stage in the loader, run here through nvImageCodec's CPU backend
(``GpuImageDecoder(device="cpu")``, the code a CUDA ``device`` runs): the hybrid split, exactly
once, order, resume mid-epoch, skip and its budget, where it may run (this process only), and
that without CUDA the default loader is what it was."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from asyncload import AsyncLoader, ImageDecoder, TooManyFailures, image_folder

nvimgcodec = pytest.importorskip("asyncload.decode.nvimgcodec")
if not nvimgcodec.available():
    pytest.skip("nvImageCodec does not import", allow_module_level=True)

from asyncload.decode.gpu import GpuImageDecoder  # noqa: E402
from tests.photos import encoded  # noqa: E402
from tests.test_batched_decode import SIZE, RecordingDecoder, run_epoch, write_folder  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The ten files of test_batched_decode and twelve more JPEGs: 22 samples."""
    root = write_folder(tmp_path_factory.mktemp("stage"))
    for index in range(12):
        (root / "d").mkdir(exist_ok=True)
        (root / f"d/{index:02}.jpg").write_bytes(encoded(("china", "flower", "grace_hopper")[index % 3], "jpeg_q90_420"))
    return root


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    """test_batched_decode's broken folder: a truncated JPEG at position 1, a text file at 9."""
    good = encoded("china", "jpeg_q90_420")
    return write_folder(tmp_path_factory.mktemp("broken"), first_broken=good[: len(good) // 2])


def hybrid(**kwargs) -> RecordingDecoder:
    return RecordingDecoder(SIZE, train=True, seed=5, split="auto", **kwargs)


def batches_equal(batches, expected) -> None:
    assert len(batches) == len(expected)
    for (images, labels), (images_cpu, labels_cpu) in zip(batches, expected):
        assert torch.equal(images, images_cpu) and torch.equal(labels, labels_cpu)


def test_the_hybrid_split_delivers_every_sample_once_in_order_with_the_cpu_path_s_pixels(folder):
    source = image_folder(str(folder))
    decoder = hybrid()
    batches, loader = run_epoch(source, decoder, batch_size=8, num_threads=3)
    row_by_row, _ = run_epoch(source, ImageDecoder(SIZE, train=True, seed=5), batch_size=8, num_threads=3)
    batches_equal(batches, row_by_row)  # train: the box decoded alone gives the CPU path's pixels
    # every row went to exactly one of the two sides, each side had some
    rows = sorted(row for call in decoder.calls + decoder.cpu_calls for row in call)
    assert rows == sorted(list(range(8)) * 2 + list(range(6)))
    assert decoder.calls and decoder.cpu_calls
    assert decoder.policy.rows["gpu"] + decoder.policy.rows["cpu"] == 22
    figures = loader.stats.as_dict()
    assert figures["decode/items"] == 22 and figures["failures"] == 0
    assert figures["decoded_on_cpu"] <= 4  # the fallbacks alone (PNG, WebP, CMYK) not the CPU share
    report = loader.stats.report()
    assert "GPU decode (auto): GPU " in report and "of 22 rows, CPU the rest" in report


@pytest.mark.parametrize("cut", [1, 2])
def test_a_resume_mid_epoch_delivers_the_rest_as_the_uninterrupted_run(folder, cut):
    source = image_folder(str(folder))
    whole, _ = run_epoch(source, hybrid(), batch_size=4)
    kwargs = {"batch_size": 4, "seed": 3, "num_threads": 2}
    with AsyncLoader(source, decode=hybrid(), **kwargs) as loader:
        first = []
        for images, labels in loader:
            first.append((images.clone(), labels.clone()))
            if len(first) == cut:
                break
        state = loader.state_dict()
    with AsyncLoader(source, decode=hybrid(), **kwargs) as loader:
        loader.load_state_dict(state)
        rest = [(images.clone(), labels.clone()) for images, labels in loader]
    batches_equal(first + rest, whole)


def test_skip_refills_failed_rows_under_the_split_and_its_budget_holds(broken):
    source = image_folder(str(broken))
    kwargs = dict(shuffle=False, on_error="skip", prefetch=1)
    batches, loader = run_epoch(source, hybrid(), max_failures=2, **kwargs)
    expected, _ = run_epoch(source, ImageDecoder(SIZE, train=True, seed=5), max_failures=2, **kwargs)
    batches_equal(batches, expected)
    assert sorted(f.item for f in loader.stats.failures) == sorted([source[1][0], source[9][0]])
    with pytest.raises(TooManyFailures):
        run_epoch(source, hybrid(), max_failures=1, **kwargs)


def test_ranks_under_the_split_take_disjoint_parts_of_every_sample(folder):
    source = image_folder(str(folder))
    seen = []
    for rank in (0, 1):
        batches, _ = run_epoch(source, hybrid(), rank=rank, world_size=2)
        expected, _ = run_epoch(source, ImageDecoder(SIZE, train=True, seed=5), rank=rank, world_size=2)
        batches_equal(batches, expected)
        seen.append([int(label) for _, labels in batches for label in labels])
    assert len(seen[0]) == len(seen[1]) == 11  # 22 samples, dealt in two equal parts


def test_a_mix_under_the_split_gives_each_source_s_rows_and_names(folder):
    from asyncload import mix

    items = [image_folder(str(folder))[index] for index in range(22)]
    source = mix({"a": items[:12], "b": items[12:]}, {"a": 0.5, "b": 0.5}, seed=1)
    kwargs = dict(batch_size=4, seed=3, num_threads=2)
    with AsyncLoader(source, decode=hybrid(), **kwargs) as loader:
        batches = [tuple(t.clone() for t in batch) for batch in loader]
    with AsyncLoader(source, decode=ImageDecoder(SIZE, train=True, seed=5), **kwargs) as loader:
        expected = [tuple(t.clone() for t in batch) for batch in loader]
    assert len(batches) == len(expected) and all(len(batch) == 3 for batch in batches)
    for batch, batch_cpu in zip(batches, expected):
        assert all(torch.equal(a, b) for a, b in zip(batch, batch_cpu))


def test_a_broken_file_raises_naming_it_under_the_split(broken):
    from asyncload import SampleError

    source = image_folder(str(broken))
    with AsyncLoader(source, batch_size=4, shuffle=False, decode=hybrid()) as loader:
        with pytest.raises(SampleError) as raised:
            list(loader)
    assert raised.value.item == source[1][0] and raised.value.stage == "decode"


def test_the_trace_shows_each_cut_and_each_side_s_calls(folder, tmp_path):
    import json

    path = tmp_path / "run.json"
    with AsyncLoader(image_folder(str(folder)), batch_size=8, decode=hybrid(), trace=str(path)) as loader:
        for _ in loader:
            pass
    events = json.loads(path.read_text())["traceEvents"]
    cuts = [event["args"] for event in events if event["name"] == "gpu split"]
    assert [cut["gpu"] + cut["cpu"] for cut in cuts] == [8, 8, 6] and cuts[0]["why"]
    decodes = [event["args"]["sample"] for event in events if event["name"] == "decode"]
    assert any(args.endswith("(CPU share)") for args in decodes)
    assert any(args.endswith("rows") for args in decodes)


def test_the_loader_tells_the_policy_the_training_step_s_time(folder):
    """Each hand-out after the first records the step (from the last hand-out to this ``next()``);
    the batches cut after it feed it to the policy. prefetch=1: batch k + 2 is cut only once batch
    k is handed out, so the last batches are cut after steps were seen."""
    decoder = hybrid()
    batches, loader = run_epoch(image_folder(str(folder)), decoder, batch_size=2, prefetch=1)
    assert len(batches) == 11
    count, seconds = loader.stats.last_step()
    assert count == 11 and seconds >= 0
    assert decoder.policy.step_s.value is not None


def test_without_cuda_the_default_is_unchanged_and_true_says_why(folder):
    source = image_folder(str(folder))
    with AsyncLoader(source) as loader:  # gpu_decode="auto" without CUDA: the CPU path, as before
        assert type(loader.settings.decode) is ImageDecoder
    with AsyncLoader(source, gpu_decode=False) as loader:
        assert type(loader.settings.decode) is ImageDecoder
    with pytest.raises(ValueError, match="gpu_decode=True needs device='cuda'"):
        AsyncLoader(source, gpu_decode=True)
    with pytest.raises(ValueError, match="gpu_decode must be 'auto', True or False"):
        AsyncLoader(source, gpu_decode="always")


@pytest.mark.parametrize("extra", [{"processes": 2}, {"isolate": True}])
def test_the_stage_runs_in_this_process_only(folder, extra):
    with pytest.raises(ValueError, match="runs in-process"):
        AsyncLoader(image_folder(str(folder)), decode=GpuImageDecoder(SIZE, device="cpu"), **extra)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_default_loader_routes_to_the_stage(folder):
    source = image_folder(str(folder))
    with AsyncLoader(source, batch_size=8, device="cuda", decode=ImageDecoder(SIZE, train=True)) as loader:
        assert isinstance(loader.settings.decode, GpuImageDecoder)
        batches = [(images.clone(), labels.clone()) for images, labels in loader]
        assert "GPU decode (auto)" in loader.stats.report()
    expected, _ = run_epoch(source, ImageDecoder(SIZE, train=True), batch_size=8, seed=0)
    torch.cuda.synchronize()
    for (images, _), (images_cpu, _) in zip(batches, expected):
        difference = np.abs(images.cpu().numpy().astype(int) - images_cpu.numpy())
        assert difference.mean() < 1.5
    with AsyncLoader(source, device="cuda", gpu_decode=False) as loader:
        assert type(loader.settings.decode) is ImageDecoder


@pytest.mark.parametrize("value", [0, 1, 0.0, "off", None])
def test_gpu_decode_takes_only_a_bool_or_auto(folder, value):
    """0 == False and 1 == True, but neither is a bool: a 0 meant as "off" must not turn the
    stage on (decode_stage with a CUDA device, no CUDA call made before the check)."""
    from asyncload.decode.gpu import decode_stage

    with pytest.raises(ValueError, match=f"gpu_decode must be 'auto', True or False, got {value!r}"):
        decode_stage(ImageDecoder(SIZE), torch.device("cuda", 0), value, 0)
    with pytest.raises(ValueError, match=f"got {value!r}"):
        AsyncLoader(image_folder(str(folder)), gpu_decode=value)


async def _read_file(path: str) -> bytes:
    return open(path, "rb").read()


def test_rows_the_gpu_would_refuse_go_to_the_cpu_jobs_from_the_start(tmp_path):
    """PNGs with their bytes in hand (``read=``): the header check at the cut sends every row to
    the CPU share's jobs; the GPU job never runs, none falls back on its single thread, each is
    counted as a fallback with its reason, and the pixels are the CPU path's."""
    for index in range(10):
        (tmp_path / "p").mkdir(exist_ok=True)
        (tmp_path / f"p/{index}.png").write_bytes(encoded(("china", "flower")[index % 2], "png_rgba"))
    source = image_folder(str(tmp_path))
    decoder = hybrid()
    batches, loader = run_epoch(source, decoder, batch_size=4, num_threads=3, read=_read_file)
    expected, _ = run_epoch(source, ImageDecoder(SIZE, train=True, seed=5), batch_size=4, num_threads=3,
                            read=_read_file)
    batches_equal(batches, expected)
    figures = loader.stats.as_dict()
    assert decoder.calls == [] and figures["decoded_on_cpu"] == 10 and figures["decoded_on_cpu/not a JPEG"] == 10
    assert sorted(row for call in decoder.cpu_calls for row in call) == sorted([0, 1, 2, 3] * 2 + [0, 1])
    assert decoder.policy.rows == {"gpu": 0, "cpu": 10} and decoder.policy.gpu.value is None


def test_gpu_decode_true_where_the_stage_cannot_run_says_so(tmp_path):
    """mds/litdata default decodes and Parquet columns= are not the stage's one image per row:
    True there is an error naming why, not silently the CPU path; "auto" keeps them as they were.
    (``default_decode`` with a CUDA device: the loader's path past the device check.)"""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from asyncload import mds, parquet
    from asyncload.settings import default_decode

    FIXTURES = Path(__file__).parent / "fixtures" / "formats"  # test_formats' committed MDS folder

    cuda = torch.device("cuda", 0)
    with pytest.raises(ValueError, match="gpu_decode=True needs the default ImageDecoder; MDSSource's default"):
        default_decode(mds(str(FIXTURES / "mds")), None, cuda, True)
    assert not isinstance(default_decode(mds(str(FIXTURES / "mds")), None, cuda, "auto"), GpuImageDecoder)
    with pytest.raises(ValueError, match="got 0"):
        default_decode(mds(str(FIXTURES / "mds")), None, cuda, 0)
    pq.write_table(pa.table({"image": [encoded("china", "jpeg_q90_420")], "label": [0], "id": [7]}), tmp_path / "c.parquet")
    columns = parquet(str(tmp_path / "c.parquet"), columns=["id"])
    with pytest.raises(ValueError, match="Parquet columns= decode each row's image with its columns beside it"):
        default_decode(columns, None, cuda, True)
    assert type(default_decode(columns, None, cuda, "auto")).__name__ == "ColumnsDecoder"


class SeeingDecoder(RecordingDecoder):
    """Notes the first bytes of every sample each GPU call (not the CPU share's) was given."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gpu_magics: list[bytes] = []

    def decode_batch(self, datas, keys, out, stream=None, rows=None, cpu_share=False):
        if not cpu_share:
            self.gpu_magics += [bytes(data[:3]) for data in datas]
        return super().decode_batch(datas, keys, out, stream=stream, rows=rows, cpu_share=cpu_share)


@pytest.mark.parametrize("split", ["auto", "gpu"])
def test_local_pngs_and_cmyk_never_enter_a_gpu_call_and_are_counted_by_reason(tmp_path, split):
    """Local files (read by the GPU job, after the cut): under "auto" the PNGs and the CMYK JPEG
    found there go to CPU jobs of their own before the GPU call, counted by reason; pinned to the
    GPU they still fall back inside its job, counted the same. Either way every sample is the CPU
    path's, exactly."""
    files = {f"a/{index}.jpg": ("china", "jpeg_q90_420") for index in range(6)}
    files.update({f"b/{index}.png": ("flower", "png_rgba") for index in range(5)})
    files.update({"c/0.jpg": ("grace_hopper", "jpeg_cmyk"), "c/1.png": ("china", "png_palette")})
    for name, (photo, variant) in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(encoded(photo, variant))
    source = image_folder(str(tmp_path))
    decoder = SeeingDecoder(SIZE, train=True, seed=5, split=split)
    batches, loader = run_epoch(source, decoder, batch_size=8, num_threads=3)
    expected, _ = run_epoch(source, ImageDecoder(SIZE, train=True, seed=5), batch_size=8, num_threads=3)
    batches_equal(batches, expected)
    figures = loader.stats.as_dict()
    assert figures["decoded_on_cpu"] == 7 and figures["failures"] == 0
    assert figures["decoded_on_cpu/not a JPEG"] == 6 and figures["decoded_on_cpu/CMYK/YCCK JPEG"] == 1
    assert "took its CPU path; CMYK/YCCK JPEG: 1; not a JPEG: 6" in loader.stats.report()
    if split == "auto":
        assert set(decoder.gpu_magics) <= {b"\xff\xd8\xff"}  # no PNG and no CMYK reached a GPU call
        assert decoder.gpu_magics.count(b"\xff\xd8\xff") <= 6
        assert decoder.policy.rows["gpu"] + decoder.policy.rows["cpu"] == 13 and decoder.policy.rows["cpu"] >= 7
