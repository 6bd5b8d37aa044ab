"""Samples that are not fixed-shape arrays (batch/ragged.py, batch/assemble.py): a detection-like
set (image, boxes N x 4, labels N, caption) from memory, tar shards and Parquet, in both modes,
under every rule of the epoch (order, skip, drop_last, resume, ranks), a field that turns ragged
late, a real mismatch, and ``collate=``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncload import AsyncLoader, SampleError, index_shards, mix, parquet, tar_shards, write_shards
from asyncload.batch.assemble import assemble, host_part
from asyncload.batch.buffers import BufferRing
from asyncload.batch.layout import SampleLayout
from asyncload.batch.ragged import grow
from tests.detection import (Detection, broken_collate, count, decode_npz, decode_webdataset, index_of, raw_image,
                             rows, sample, to_targets, write_npz_files, write_webdataset_tar)

MODES = [0, 2]
N = 50


def detection_loader(processes: int, n: int = N, decode=None, **options) -> AsyncLoader:
    options = {"batch_size": 8, "shuffle": False, **options}
    return AsyncLoader(list(range(n)), read=False, decode=decode or Detection(), processes=processes, **options)


def all_rows(loader, steady: int = 0) -> list[list[int]]:
    return [rows(batch, steady) for batch in loader]


@pytest.mark.parametrize("processes", MODES)
def test_each_row_brings_its_own_boxes_labels_and_caption_once_in_order(processes):
    with detection_loader(processes) as loader:
        batches = list(loader)
        got = [rows(batch) for batch in batches]
    assert sum(got, []) == list(range(N))
    last = batches[-1]
    assert last["boxes"].layout == torch.jagged and last["boxes"].dtype == torch.float32
    assert last["labels"].layout == torch.jagged and last["labels"].dtype == torch.int64
    assert isinstance(last["caption"], list) and last["image"].shape == (2, 4, 4, 3)
    assert any(count(i) == 0 for i in range(N)) and max(count(i) for i in range(N)) == 30  # empty rows, long rows


@pytest.mark.parametrize("processes", MODES)
def test_tar_shards_written_by_write_shards(processes, tmp_path):
    (tmp_path / "npz").mkdir()
    write_shards(write_npz_files(str(tmp_path / "npz"), 30), str(tmp_path / "shards"), samples_per_shard=8)
    source = tar_shards(str(tmp_path / "shards"), members="all")
    with AsyncLoader(source, batch_size=8, shuffle=False, decode=decode_npz, processes=processes) as loader:
        assert sum(all_rows(loader), []) == list(range(30))


def test_webdataset_style_tar_shards(tmp_path):
    for shard in range(2):
        write_webdataset_tar(str(tmp_path / f"{shard}.tar"), 12)
    index_shards([str(tmp_path / f"{shard}.tar") for shard in range(2)])
    source = tar_shards(str(tmp_path), members="all")
    with AsyncLoader(source, batch_size=5, shuffle=True, decode=decode_webdataset, processes=0) as loader:
        got = sum(all_rows(loader), [])
    assert sorted(got) == sorted(list(range(12)) * 2)


@pytest.mark.parametrize("processes", MODES)
def test_parquet_list_columns_are_ragged_and_struct_columns_dicts(processes, tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    samples = [sample(i) for i in range(40)]
    table = pa.table({
        "image": [s["image"].tobytes() for s in samples],
        "boxes": pa.array([s["boxes"].ravel() for s in samples], pa.list_(pa.float32())),
        "labels": pa.array([s["labels"] for s in samples], pa.list_(pa.int64())),
        "caption": [s["caption"] for s in samples],
        "meta": [{"id": i, "name": f"n{i}"} for i in range(40)],
    })
    pq.write_table(table, str(tmp_path / "d.parquet"), row_group_size=16)
    source = parquet(str(tmp_path / "d.parquet"), label=None, columns=["boxes", "labels", "caption", "meta"])
    with AsyncLoader(source, batch_size=8, shuffle=False, decode=raw_image, processes=processes) as loader:
        got = []
        for batch in loader:
            assert batch["boxes"].layout == torch.jagged and batch["labels"].dtype == torch.int64
            batch["boxes"] = torch.nested.nested_tensor_from_jagged(  # the column is flat: N * 4 values a row
                batch["boxes"].values().view(-1, 4), batch["boxes"].offsets() // 4)
            got += rows(batch)
            assert batch["meta"]["id"].tolist() == got[-len(batch["caption"]):]
            assert batch["meta"]["name"] == [f"n{i}" for i in got[-len(batch["caption"]):]]
    assert got == list(range(40))


@pytest.mark.parametrize("processes", MODES)
def test_a_resume_mid_epoch_gives_the_rest_with_their_fields(processes):
    options = dict(shuffle=True, seed=3)
    with detection_loader(processes, **options) as loader:
        whole = all_rows(loader)
        loader.set_epoch(0)
        iterator = iter(loader)
        head = [rows(next(iterator)) for _ in range(3)]
        state = loader.state_dict()
        del iterator
    with detection_loader(processes, **options) as resumed:
        resumed.load_state_dict(state)
        assert head + all_rows(resumed) == whole


@pytest.mark.parametrize("processes", MODES)
def test_skipped_samples_are_replaced_and_every_other_row_keeps_its_fields(processes):
    with detection_loader(processes, decode=Detection(bad={3, 17, 48}), on_error="skip", max_failures=3) as loader:
        got = sum(all_rows(loader), [])
        assert sorted(got) == [i for i in range(N) if i not in (3, 17, 48)]  # 48: a hole, 49 moved into it
        assert [failure.item for failure in loader.stats.failures] == [3, 17, 48]


@pytest.mark.parametrize("processes", MODES)
def test_a_rank_of_two_with_drop_last_gets_its_share_with_the_fields_of_each(processes):
    with detection_loader(processes, rank=1, world_size=2, shuffle=True, seed=1, drop_last=True) as loader:
        got = all_rows(loader)
    assert [len(b) for b in got] == [8] * 3  # 25 samples for the rank: the last 1 dropped
    assert sum(got, []) == loader.sampler.order(0).tolist()[:24]


@pytest.mark.parametrize("processes", MODES)
def test_a_field_that_turns_ragged_after_the_first_batches_stays_ragged(processes):
    """Samples 0..23 have 3 boxes each (fixed so far); later ones vary, some longer than the
    room the field first gets: no row is lost or moved, and every batch from the turn on (and
    in the next epoch, all) is jagged. The turn is the run's layout at hand-out: batch 3 (rows
    24..31) turns it at the latest, earlier when it was decoded before an earlier batch was
    handed out (two children decode 4 batches ahead: then even batch 0 may come jagged; one
    process decodes 2 ahead, so its batch 0 comes fixed)."""
    steady = 24
    with detection_loader(processes, decode=Detection(steady=steady), prefetch=1) as loader:
        batches = list(loader)
        assert sum((rows(b, steady) for b in batches), []) == list(range(N))
        nested = [b["boxes"].is_nested for b in batches]
        turned = nested.index(True)
        assert turned <= steady // 8
        if processes == 0:
            assert turned >= 1
        assert all(b["boxes"].shape == (8, 3, 4) for b in batches[:turned])
        assert all(b["boxes"].is_nested and b["labels"].is_nested for b in batches[turned:])
        again = list(loader)
        assert sum((rows(b, steady) for b in again), []) == list(range(N))
        assert all(b["boxes"].is_nested for b in again)


@pytest.mark.parametrize("processes", MODES)
def test_a_real_mismatch_names_the_sample_the_field_and_both_shapes(processes):
    with detection_loader(processes, decode=Detection(changed=13)) as loader:
        with pytest.raises(SampleError) as raised:
            list(loader)
    message = str(raised.value)
    assert message.startswith("sample 13 failed at decode") and "'boxes' is int32 array of shape (29, 4)" in message
    assert "before it had float32 arrays of shape (" in message, message


def test_a_string_where_an_array_was_is_a_mismatch():
    def decode(index):
        return {"x": np.zeros(2) if index != 5 else "text"}
    with AsyncLoader(list(range(8)), batch_size=4, shuffle=False, read=False, decode=decode, processes=0) as loader:
        with pytest.raises(SampleError, match=r"field 'x' is str, but the samples before it had float64 arrays"):
            list(loader)


def test_arrays_of_other_trailing_shapes_come_as_lists_and_objects_as_lists():
    def decode(index):
        return (np.ones((2, index + 1), np.float32), b"%d" % index, {"id": index, "tags": None})
    with AsyncLoader(list(range(10)), batch_size=4, shuffle=False, read=False, decode=decode, processes=0) as loader:
        batches = list(loader)
    values = sum((list(b[0]) for b in batches), [])
    assert [tuple(v.shape) for v in values] == [(2, i + 1) for i in range(10)]
    assert sum((b[1] for b in batches), []) == [b"%d" % i for i in range(10)]
    assert sum((b[2]["id"].tolist() for b in batches), []) == list(range(10))
    assert batches[0][2]["tags"] == [None] * 4


@pytest.mark.parametrize("processes", MODES)
def test_collate_shapes_each_batch(processes):
    with detection_loader(processes, collate=to_targets) as loader:
        got = []
        for images, targets in loader:
            assert isinstance(targets, list) and len(targets) == len(images)
            for image, target in zip(images, targets):
                index = index_of(image)
                assert torch.equal(target["boxes"], torch.from_numpy(sample(index)["boxes"]))
                got.append(index)
    assert got == list(range(N))


def test_what_collate_raises_names_the_batch():
    with detection_loader(0, collate=broken_collate) as loader:
        with pytest.raises(RuntimeError, match=r"collate= failed on batch 0 \(epoch positions 0, 1, 2, 3, \.\.\.\): "
                                               r"KeyError") as raised:
            list(loader)
    assert isinstance(raised.value.__cause__, KeyError)


@pytest.mark.parametrize("processes", MODES)
def test_a_mix_keeps_each_rows_fields_and_its_source(processes):
    sources = {"a": list(range(20)), "b": list(range(100, 120))}
    with AsyncLoader(mix(sources, weights={"a": 0.5, "b": 0.5}), batch_size=8, read=False, decode=Detection(),
                     processes=processes) as loader:
        got = [(rows(sample), numbers.tolist()) for sample, numbers in loader]
    indices, numbers = sum((g[0] for g in got), []), sum((g[1] for g in got), [])
    assert sorted(indices) == list(range(20)) + list(range(100, 120))
    assert numbers == [int(index >= 100) for index in indices]


def test_a_sample_of_text_alone_gives_lists_of_text():
    with AsyncLoader(list(range(10)), batch_size=4, shuffle=False, read=False, decode=str, processes=0) as loader:
        assert list(loader) == [["0", "1", "2", "3"], ["4", "5", "6", "7"], ["8", "9"]]


def test_what_a_device_hand_out_reads_on_the_host_is_copied_when_the_copy_starts():
    """With a device stage a buffer may be reused once its copy is done, before its batch is
    handed out: the hand-out then reads the lengths and the values aside from ``host_part``."""
    layout = grow(SampleLayout.of(sample(0)), {(1, 1): sample(1)["boxes"], (1, 2): sample(1)["labels"]})
    ring = BufferRing(keep=2, pin_memory=False)
    ring.configure(layout, 4)
    buffer = ring.take()
    for row in range(4):  # row 3's 21 boxes are past the room (14): they go aside
        buffer.write(row, sample(row))
    storage = [tensor[:4].clone() for tensor in buffer.tensors]  # what the device copy holds
    host = host_part(buffer, 4)
    for row in range(4):
        buffer.write(row, sample(10 + row))
    assert rows(layout.unflatten(assemble(host, storage, 4, layout))) == [0, 1, 2, 3]
