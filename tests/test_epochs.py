"""Which epoch a pass over the loader runs: each new pass is the next epoch (a new order and new
augmentations, as ``DataLoader(shuffle=True)``), unless ``set_epoch`` or ``load_state_dict`` chose
it; ``state_dict()`` records the epoch, and a resume continues it. The same with ``processes=0``
and ``processes=2`` (the children decode with the epoch the driver sends).

Each row is ``[source index, epoch of the augmentation key]``: the decoder writes its row in place
from the ``(epoch, index)`` key the loader passes, as ``ImageDecoder`` draws its crops from it.
"""

from __future__ import annotations

import numpy as np
import pytest

from asyncload import AsyncLoader
from asyncload.batch.buffers import Field

MODES = [0, 2]
N = 20


class KeyedDecode:
    """An in-place decoder (as ``ImageDecoder``) whose row says which sample and which epoch's
    random stream it was given. Top-level: the children unpickle it."""

    field = Field((2,), np.dtype(np.int64))

    def decode_into(self, data, out, key):
        epoch, index = key
        assert index == data
        out[:] = (data, epoch)


def loader_for(processes, **kwargs):
    options = dict(batch_size=4, shuffle=True, seed=3, read=False, decode=KeyedDecode(), num_threads=2)
    return AsyncLoader(list(range(N)), processes=processes, **{**options, **kwargs})


def one_pass(loader, batches=None):
    """The samples of a pass (its first ``batches`` only, then left) and the epoch of their keys."""
    samples, epochs = [], set()
    for number, batch in enumerate(loader):
        samples += batch[:, 0].tolist()
        epochs |= set(batch[:, 1].tolist())
        if number + 1 == batches:
            break
    (epoch,) = epochs
    return samples, epoch


def order(loader, epoch):
    return loader.sampler.order(epoch).tolist()


@pytest.mark.parametrize("processes", MODES)
def test_each_new_pass_is_the_next_epoch(processes):
    with loader_for(processes) as loader:
        first, second, third = one_pass(loader), one_pass(loader), one_pass(loader)
        assert loader.state_dict()["epoch"] == 3 and loader.state_dict()["delivered"] == []
    assert first == (order(loader, 0), 0) and second == (order(loader, 1), 1) and third == (order(loader, 2), 2)
    assert first[0] != second[0] != third[0], "a new order each pass"
    with loader_for(processes) as pinned:
        explicit = []
        for epoch in range(3):
            pinned.set_epoch(epoch)
            explicit.append(one_pass(pinned))
    assert explicit == [first, second, third], "the same passes as with set_epoch(0), (1), (2)"


@pytest.mark.parametrize("processes", MODES)
def test_set_epoch_chooses_the_pass_and_the_next_pass_follows_it(processes):
    with loader_for(processes) as loader:
        loader.set_epoch(5)
        assert loader.state_dict()["epoch"] == 5
        iterator = iter(loader)
        head = next(iterator)[:, 0].tolist()
        assert loader.state_dict()["epoch"] == 5 and loader.state_dict()["delivered"] == [[0, 4]]
        rest = sum((batch[:, 0].tolist() for batch in iterator), [])
        assert head + rest == order(loader, 5)
        assert one_pass(loader) == (order(loader, 6), 6)
        loader.set_epoch(6)  # a pass of 6 ran: set_epoch(6) runs it again, from its start
        assert one_pass(loader) == (order(loader, 6), 6)
        assert one_pass(loader) == (order(loader, 7), 7)


@pytest.mark.parametrize("processes", MODES)
def test_a_pass_left_early_is_followed_by_the_next_epoch_and_its_state_resumes_it(processes):
    with loader_for(processes) as loader:
        head, epoch = one_pass(loader, batches=2)
        state = loader.state_dict()  # taken after leaving the loop: the epoch left, as it stood
        assert (head, epoch) == (order(loader, 0)[:8], 0)
        assert state["epoch"] == 0 and state["delivered"] == [[0, 8]]
        assert one_pass(loader) == (order(loader, 1), 1), "a new pass is the next epoch, whole"
        assert one_pass(loader, batches=1) == (order(loader, 2)[:4], 2)
        loader.load_state_dict(state)  # the way back to the epoch left, in this process too
        assert one_pass(loader) == (order(loader, 0)[8:], 0)
        assert one_pass(loader) == (order(loader, 1), 1)
    with loader_for(processes) as resumed:
        resumed.load_state_dict(state)
        assert resumed.state_dict()["epoch"] == 0
        assert one_pass(resumed) == (order(resumed, 0)[8:], 0), "without set_epoch: the saved epoch's rest"
        assert one_pass(resumed) == (order(resumed, 1), 1)


@pytest.mark.parametrize("processes", MODES)
def test_the_resume_loop_with_set_epoch_keeps_its_place(processes):
    """The loop of a training script: load the state, then set_epoch(e) for each epoch from the
    saved one on."""
    with loader_for(processes) as loader:
        loader.set_epoch(4)
        state = None
        for number, batch in enumerate(loader):
            if number == 1:
                state = loader.state_dict()
        finished = loader.state_dict()
    assert state["epoch"] == 4 and state["delivered"] == [[0, 8]]
    assert finished["epoch"] == 5 and finished["delivered"] == [], "after a whole pass: the next epoch"
    with loader_for(processes) as resumed:
        resumed.load_state_dict(state)
        passes = []
        for epoch in range(state["epoch"], 6):
            resumed.set_epoch(epoch)
            passes.append(one_pass(resumed))
    assert passes == [(order(resumed, 4)[8:], 4), (order(resumed, 5), 5)]
    with loader_for(0) as after_the_pass:  # a checkpoint taken at the end of an epoch
        after_the_pass.load_state_dict(finished)
        assert one_pass(after_the_pass) == (order(after_the_pass, 5), 5)
