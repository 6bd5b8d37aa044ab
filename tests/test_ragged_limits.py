"""The limits of ragged fields (batch/ragged.py): the room a ragged field takes per row follows
the batches' typical lengths, not one huge sample; values that cannot be stored exactly in a
field's dtype, and samples whose fields change kind, are errors naming the sample and the field;
``normalize=`` converts fixed image fields only."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncload import AsyncLoader, SampleError
from asyncload.batch.buffers import BufferRing
from asyncload.batch.layout import SampleLayout
from asyncload.batch import ragged
from asyncload.batch.assemble import assemble, host_part
from asyncload.batch.ragged import grow
from asyncload.device import Normalize, copy_rows, normalize_fixed

MODES = [0, 2]
HUGE = 10**5


def boxes_of(index: int) -> np.ndarray:
    count = HUGE if index == 13 else index % 5
    return np.full((count, 4), index, np.float32)


def decode_one_huge(index: int) -> dict:
    return {"id": np.int64(index), "boxes": boxes_of(index)}


def loader_of(decode, processes: int, n: int = 24, **options) -> AsyncLoader:
    return AsyncLoader(list(range(n)), batch_size=8, shuffle=False, read=False, decode=decode, processes=processes,
                       **options)


@pytest.mark.parametrize("processes", MODES)
def test_one_huge_sample_arrives_but_does_not_make_every_buffer_huge(processes):
    with loader_of(decode_one_huge, processes) as loader:
        got = []
        for batch in loader:
            for index, boxes in zip(batch["id"].tolist(), batch["boxes"].unbind()):
                assert torch.equal(boxes, torch.from_numpy(boxes_of(index)))
                got.append(index)
        room = loader._backend.ring.layout.fields[1].shape[0]  # the run's buffers
    assert got == list(range(24))
    assert room < 100, room


def test_room_grows_from_the_typical_lengths_within_a_byte_budget():
    layout = SampleLayout.of({"x": np.zeros((3, 2), np.float32)})
    turned = grow(layout, {(0, 0): np.zeros((5, 2), np.float32)}, rows=8)  # one of 8 longer: typical 3
    assert turned.leaves[0].kind == "ragged" and turned.fields[0].shape == (8, 2)
    same = grow(turned, {(1, 0): np.zeros((50, 2), np.float32)}, rows=8)  # one aside of 8: no growth
    assert same is turned
    many = {(row, 0): np.zeros((40 + row, 2), np.float32) for row in range(6)}  # most of the batch longer
    assert grow(turned, many, rows=8).fields[0].shape == (88, 2)
    wide = {(row, 0): np.zeros((10**7, 2), np.float32) for row in range(8)}  # capped by the byte budget
    assert grow(turned, wide, rows=8).fields[0].shape == (ragged.RAGGED_BYTES // (8 * 8), 2)


def test_a_copy_to_the_device_takes_the_used_part_of_a_ragged_field():
    samples = [{"x": np.full((n, 2), n, np.float32)} for n in (3, 1, 5, 0)]
    layout = grow(SampleLayout.of(samples[0]), {(1, 0): samples[1]["x"]}, rows=4)
    ring = BufferRing(keep=1, pin_memory=False)
    ring.configure(layout, 4)
    buffer = ring.take()
    for row, sample in enumerate(samples):
        buffer.write(row, sample)
    assert buffer.tensors[0].shape == (4, 8, 2)
    assert [tuple(part.shape) for part in ragged.used_parts(buffer, 4)] == [(4, 5, 2), (4,)]


def test_normalize_converts_fixed_image_fields_only_also_on_the_device_path():
    """A ragged uint8 field's storage ``[B, cap, W, C]`` looks like an image batch: the device
    copy (``copy_rows``, run here on the CPU) and both hand-outs (``normalize_fixed``) leave it
    as it is and convert the fixed image field."""
    def sample(index: int) -> dict:
        return {"image": np.full((2, 2, 3), 10 * index, np.uint8), "crop": np.full((2 + index, 5, 3), index, np.uint8)}
    layout = grow(SampleLayout.of(sample(0)), {(1, 1): sample(1)["crop"]}, rows=4)
    ring = BufferRing(keep=1, pin_memory=False)
    ring.configure(layout, 4)
    buffer = ring.take()
    for row in range(4):
        buffer.write(row, sample(row))
    normalize = Normalize([0.0] * 3, [1.0] * 3)
    storage = copy_rows(buffer, 4, torch.device("cpu"), normalize)
    leaves = normalize_fixed(assemble(host_part(buffer, 4), storage, 4, layout), normalize)
    image, crop = layout.unflatten(leaves).values()
    assert image.dtype == torch.float32 and image.shape == (4, 3, 2, 2)
    assert torch.equal(image[:, 0, 0, 0], torch.tensor([0.0, 10.0, 20.0, 30.0]) / 255)
    assert crop.is_nested and [tuple(rows.shape) for rows in crop.unbind()] == [(2 + row, 5, 3) for row in range(4)]
    assert all(torch.equal(rows, torch.from_numpy(sample(row)["crop"])) for row, rows in enumerate(crop.unbind()))


def decode_labels_then_a_wide_one(index: int) -> dict:
    """int32 labels of 1..3 values; sample 11's are int64 past int32's range."""
    wide = index == 11
    return {"id": np.int64(index), "labels": np.full(index % 3 + 1, 2**33 + 5 if wide else index,
                                                     np.int64 if wide else np.int32)}


@pytest.mark.parametrize("processes", MODES)
def test_a_value_the_fields_dtype_cannot_hold_exactly_is_an_error_not_a_wrapped_number(processes):
    with loader_of(decode_labels_then_a_wide_one, processes) as loader:
        with pytest.raises(SampleError, match=r"^sample 11 failed at decode: FieldMismatch: field 'labels' is int64 "
                                              r"array of shape \(3,\), but the samples before it had int32 arrays .*"
                                              r"\(a int32 field cannot hold int64 values exactly"):
            list(loader)


@pytest.mark.parametrize(("value", "was", "got"), [
    (None, "float64", "NoneType"),  # a missing number (a Parquet struct's null)
    (1.5, "int64", "float64 array of shape ()"),  # an int field, later a float
    (np.int64(10**9 + 1), "float32", "int64 array of shape ()"),  # would round to 1e9
])
def test_a_fixed_field_of_another_dtype_or_none_names_the_field_and_both_dtypes(value, was, got):
    def decode(index: int) -> dict:
        first = np.float32(index) if was == "float32" else (float(index) if was == "float64" else index)
        return {"id": np.int64(index), "meta": {"score": value if index == 5 else first}}
    with loader_of(decode, 0, n=8) as loader:
        with pytest.raises(SampleError) as raised:
            list(loader)
    assert str(raised.value).startswith(f"sample 5 failed at decode: FieldMismatch: field 'meta.score' is {got}, "
                                        f"but the samples before it had {was} arrays of shape ()"), str(raised.value)


def test_a_row_missing_its_value_aside_is_a_bug_not_a_none():
    layout = SampleLayout.of({"id": np.int64(0), "caption": "a"})
    ring = BufferRing(keep=1, pin_memory=False)
    ring.configure(layout, 4)
    buffer = ring.take()
    for row in range(3):
        buffer.write(row, {"id": np.int64(row), "caption": f"c{row}"})
    assert assemble(host_part(buffer, 3), buffer.views(3), 3, layout)[1] == ["c0", "c1", "c2"]
    del buffer.side[1, 1]
    with pytest.raises(AssertionError, match=r"rows \[1\] have no value aside for leaf 1: the batch lost them"):
        assemble(host_part(buffer, 3), buffer.views(3), 3, layout)


def decode_wider_images(index: int) -> dict:
    return {"image": np.full((2, 1 + index, 3), index, np.uint8), "caption": "ab" * index}


@pytest.mark.parametrize("processes", MODES)
def test_the_stats_count_the_bytes_kept_aside(processes):
    """A caption goes aside (with ``processes=N`` pickled in the child's answer): the stats say
    how many bytes. Images of varying width arrive whole, in their rows."""
    with loader_of(decode_wider_images, processes, n=10) as loader:
        images = [image for batch in loader for image in batch["image"]]
        aside = loader.stats.snapshot().aside_bytes
    assert [tuple(image.shape) for image in images] == [(2, 1 + index, 3) for index in range(10)]
    assert all(bool((image == index).all()) for index, image in enumerate(images))
    captions = sum(2 * index for index in range(10))
    assert captions <= aside <= captions + sum(6 * (1 + index) for index in range(1, 10)), aside


def test_arrays_whose_other_dimensions_vary_are_written_in_place_not_kept_aside():
    samples = [{"image": np.full((2, 1 + index, 3), index, np.uint8)} for index in range(6)]
    layout = grow(SampleLayout.of(samples[0]), {(1, 0): samples[1]["image"]}, rows=6)
    assert layout.leaves[0].kind == "list" and [field.shape for field in layout.fields] == [(12,), (), (3,)]
    ring = BufferRing(keep=1, pin_memory=False)
    ring.configure(layout, 6)
    buffer = ring.take()
    for row, sample in enumerate(samples):
        buffer.write(row, sample)
    assert sorted(buffer.side) == [(2, 0), (3, 0), (4, 0), (5, 0)]  # 18 values and more: past the room (12)
    images = assemble(host_part(buffer, 6), buffer.views(6), 6, layout)[0]
    assert [tuple(image.shape) for image in images] == [(2, 1 + index, 3) for index in range(6)]
    assert all(bool((image == index).all()) for index, image in enumerate(images))
