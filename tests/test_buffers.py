import numpy as np
import pytest
import torch

from asyncload.buffers import BufferRing, SampleLayout


def test_layout_round_trips_nested_samples():
    sample = {"image": np.zeros((2, 3), np.uint8), "meta": (np.float32(1.5), 7)}
    layout = SampleLayout.of(sample)
    assert [f.shape for f in layout.fields] == [(2, 3), (), ()]
    assert [f.dtype for f in layout.fields] == [np.uint8, np.float32, np.int64]
    rebuilt = layout.unflatten(["a", "b", "c"])
    assert rebuilt == {"image": "a", "meta": ("b", "c")}


def test_layout_rejects_a_sample_of_another_shape_or_structure():
    layout = SampleLayout.of((np.zeros(3), 1))
    with pytest.raises(ValueError, match=r"shape \(4,\) differs"):
        layout.flatten((np.zeros(4), 1))
    with pytest.raises(ValueError, match="structure"):
        layout.flatten(np.zeros(3))


def ring_with(keep=2):
    ring = BufferRing(keep=keep, pin_memory=False)
    ring.configure(SampleLayout.of((np.zeros(4, np.float32), 0)), capacity=3)
    return ring


def test_written_rows_appear_in_the_batch():
    buffer = ring_with().take()
    for row in range(3):
        buffer.write(row, (np.full(4, row, np.float32), row * 10))
    values, labels = buffer.batch(2)
    assert values.tolist() == [[0] * 4, [1] * 4]
    assert labels.tolist() == [0, 10]
    assert isinstance(values, torch.Tensor) and values.dtype == torch.float32


def test_a_buffer_in_the_pipeline_or_held_by_the_user_is_not_reused():
    ring = ring_with()
    first = ring.take()
    assert ring.take() is not first, "a buffer being filled must not be taken twice"
    held = first.batch(3)
    assert ring.take() is not first, "the user still holds it"
    view = held[0][1:]  # a view of a view keeps the memory alive too
    del held
    assert ring.take() is not first
    del view
    assert first.is_free()


def test_a_released_buffer_is_reused_without_allocating():
    ring = ring_with()
    first = ring.take()
    pointer = first.tensors[0].data_ptr()
    first.batch(3)  # handed out and dropped at once
    again = ring.take()
    assert again is first and again.tensors[0].data_ptr() == pointer


def test_given_back_buffers_are_reused():
    ring = ring_with()
    first = ring.take()
    first.give_back()
    assert ring.take() is first


def test_the_ring_tracks_at_most_keep_buffers():
    ring = ring_with(keep=2)
    held = [ring.take().batch(3) for _ in range(5)]
    assert len(ring._buffers) == 2
    assert len({h[0].data_ptr() for h in held}) == 5, "each held batch has its own memory"
