import numpy as np
import pytest
import torch

from asyncload.batch.buffers import BufferRing
from asyncload.batch.layout import SampleLayout


def test_layout_round_trips_nested_samples():
    sample = {"image": np.zeros((2, 3), np.uint8), "meta": (np.float32(1.5), 7)}
    layout = SampleLayout.of(sample)
    assert [f.shape for f in layout.fields] == [(2, 3), (), ()]
    assert [f.dtype for f in layout.fields] == [np.uint8, np.float32, np.int64]
    rebuilt = layout.unflatten(["a", "b", "c"])
    assert rebuilt == {"image": "a", "meta": ("b", "c")}


def test_a_sample_of_another_shape_goes_aside_and_another_structure_raises():
    ring = BufferRing(keep=2, pin_memory=False)
    ring.configure(SampleLayout.of((np.zeros(3), 1)), capacity=2)
    buffer = ring.take()
    buffer.write(0, (np.zeros(4), 1))  # another length: kept aside, the field may turn ragged
    assert list(buffer.side) == [(0, 0)] and buffer.side[0, 0].shape == (4,)
    with pytest.raises(ValueError, match="structure"):
        buffer.write(1, np.zeros(3))


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


def test_recycling_needs_no_private_torch_api(monkeypatch):
    """Whether a buffer is free is told with public means (a weak reference to what the handed
    tensors hold), not torch's private storage use count."""

    def private(*_):
        raise AssertionError("private torch API used")

    monkeypatch.setattr(torch._C, "_storage_Use_Count", private, raising=False)
    ring = ring_with()
    buffer = ring.take()
    kept = buffer.batch(2)
    assert not buffer.is_free()
    del kept
    assert buffer.is_free() and ring.take() is buffer


@pytest.mark.parametrize("keep", [
    lambda batch: batch[0][1:],                  # a slice
    lambda batch: batch[1].numpy(),              # a NumPy array of a field
    lambda batch: batch[0][0].view(torch.int32),  # a view of a row in another dtype
])
def test_any_view_of_a_handed_batch_keeps_its_buffer(keep):
    ring = ring_with()
    buffer = ring.take()
    view = keep(buffer.batch(3))
    assert not buffer.is_free()
    del view
    assert buffer.is_free()


def test_a_pinned_batch_is_reused_only_after_the_user_moved_on():
    """Pinned memory: a copy to the GPU the user queued may still read the batch after the user
    dropped it. The buffer waits for ``released()`` (the user asking for the next batch), which
    with CUDA in use records the event the GPU must pass first. A CPU buffer declared pinned
    runs the same rule without CUDA."""
    ring = ring_with()
    buffer = ring.take()
    buffer.pinned = True
    buffer.batch(3)  # handed out and dropped at once
    assert not buffer.is_free(), "reused before the user asked for the next batch"
    assert ring.take() is not buffer
    buffer.released()
    assert buffer.is_free() and ring.take() is buffer
    buffer.in_pipeline = False
    kept = buffer.batch(1)
    buffer.released()
    assert not buffer.is_free(), "moving on does not free a batch the user still holds"
    del kept
    assert buffer.is_free()


def test_a_forgotten_buffer_lives_on_while_the_gpu_may_read_it():
    """Past ``keep`` the ring stops tracking its oldest buffers, whose memory goes when the user
    drops them. Pinned memory that a queued copy may still read must not go back to PyTorch's
    pinned allocator (which would hand it out again at once) before the user moved on."""
    import gc
    import weakref

    ring = ring_with(keep=1)
    buffer = ring.take()
    buffer.pinned = True
    buffer.batch(3)  # handed out and dropped, the user's copy maybe still queued
    alive = weakref.ref(buffer)
    del buffer
    ring.take(), ring.take()  # the ring forgets it
    gc.collect()
    assert alive() is not None, "freed while a copy of the user's may still read it"
    alive().released()
    ring.take()
    gc.collect()
    assert alive() is None, "kept after the GPU was done with it"


def test_a_poisoned_buffer_is_never_taken_again():
    """An abandoned ``decode_into`` may still write its buffer: once poisoned, the ring never
    hands it out again, even given back and with nothing else holding it."""
    ring = ring_with(keep=4)
    poisoned = ring.take()
    poisoned.poisoned = True
    poisoned.give_back()
    taken = [ring.take() for _ in range(3)]
    assert all(buffer is not poisoned for buffer in taken)
    for buffer in taken:
        buffer.give_back()
    assert ring.take() is not poisoned


def test_a_batch_moved_off_a_poisoned_buffer_keeps_its_rows_and_takes_replacements_in_the_fresh_one():
    from asyncload.epoch.in_flight import InFlight

    ring = ring_with(keep=4)
    batch = InFlight(0, [0, 1, 2], ring.take())
    for row in range(3):
        batch.buffer.write(row, (np.full(4, row, np.float32), row))
    old = batch.buffer
    old.poisoned = True
    batch.leave_if_poisoned(ring.take)
    batch.sending([1])  # row 1's replacement goes to the fresh buffer
    batch.buffer.write(1, (np.full(4, 7, np.float32), 7))
    old.write(1, (np.full(4, -1, np.float32), -1))  # the stuck decode's late write
    batch.gather()
    values, labels = batch.buffer.batch(3)
    assert labels.tolist() == [0, 7, 2] and values[:, 0].tolist() == [0, 7, 2]
    old.write(0, (np.full(4, -1, np.float32), -1))  # later still: the batch handed out does not change
    assert labels.tolist() == [0, 7, 2]
