"""Elastic resume: a job saved by W ranks goes on with N. Each new rank loads the list of every old
rank's ``state_dict()``; across the new ranks the rest of the epoch is exactly the samples no old
rank handed out, each once (plus padding repeats to equal batch counts), and the next epoch is the
new world size's own. Old ranks stop at different batches, as a job killed mid-step leaves them.

Integer samples (``read=False``, a decode that returns the index) say exactly which samples a batch
holds; the shard case reads the real JPEGs from tar shards. What the children run (``processes=2``)
is defined at module level.
"""

from __future__ import annotations

from collections import Counter

import pytest

from asyncload import AsyncLoader, ImageDecoder, tar_shards
from tests.conftest import CLASSES, PER_CLASS, identify
from tests.decoders import FailsOn, as_array

MODES = [0, 2]


def int_loader(n, rank, world_size, processes=0, **kwargs):
    options = dict(batch_size=4, read=False, decode=as_array, num_threads=2, seed=11)
    return AsyncLoader(list(range(n)), rank=rank, world_size=world_size, processes=processes, **{**options, **kwargs})


def ints(batch):
    return batch[:, 0].tolist()


def run_partway(make, world_size, stops, samples=ints):
    """Old rank ``r`` hands out ``stops[r]`` batches and saves its state: (what all of them
    delivered, their states in rank order)."""
    delivered, states = [], []
    for rank, stop in enumerate(stops):
        with make(rank, world_size) as loader:
            batches = iter(loader)
            for _ in range(stop):
                delivered += samples(next(batches))
            states.append(loader.state_dict())
            batches.close()
    return delivered, states


def check_rest(old, new, everything):
    """The new ranks deliver every sample the old ones did not, each once, plus padding repeats
    of rest samples only as many as deal the rest evenly; every new rank the same batch count."""
    rest = sorted(set(everything) - set(old))
    assert len(old) == len(set(old))
    assert {len(batches) for batches in new} == {len(new[0])}, "equal batch counts across new ranks"
    given = [sample for batches in new for batch in batches for sample in batch]
    assert sorted(set(given)) == rest and not set(given) & set(old)
    per_rank = -(-len(rest) // len(new))
    assert len(given) == per_rank * len(new)  # the repeats deal the rest evenly, nothing more
    assert sum(count - 1 for count in Counter(given).values()) == per_rank * len(new) - len(rest)


@pytest.mark.parametrize("processes", MODES)
def test_four_ranks_resume_on_two(processes):
    n = 50  # 13 per old rank with 2 padding repeats, 26 left for two new ranks
    make = lambda rank, world: int_loader(n, rank, world, processes)  # noqa: E731
    old, states = run_partway(make, 4, [1, 2, 3, 0])
    new = []
    for rank in range(2):
        with make(rank, 2) as loader:
            loader.load_state_dict(states)
            new.append([ints(batch) for batch in loader])
            assert loader.epoch == 1
            assert [ints(batch) for batch in loader] == fresh_epoch(n, rank, 2, 1), "next epoch: the new world's"
    assert sorted(old) != list(range(len(old))), "shuffled"
    check_rest(old, new, range(n))
    assert [len(b) for b in new[0]] == [4, 4, 4, 1]
    # The same list on rank 1, saved after one batch and resumed, gives the same rest.
    with make(1, 2) as loader:
        loader.load_state_dict(states)
        batches = iter(loader)
        first = ints(next(batches))
        state = loader.state_dict()
        batches.close()
    assert state["elastic"]["world_size"] == 4 and state["delivered"] == [[0, 4]]
    with make(1, 2) as loader:
        loader.load_state_dict(state)
        assert [first, *[ints(batch) for batch in loader]] == new[1]


def fresh_epoch(n, rank, world_size, epoch, **kwargs):
    with int_loader(n, rank, world_size, **kwargs) as loader:
        loader.set_epoch(epoch)
        return [ints(batch) for batch in loader]


@pytest.mark.parametrize("processes", MODES)
def test_one_rank_resumes_on_four_without_a_skipped_sample(processes):
    """The skipped (corrupt) sample is done: no new rank reads it again or counts it."""
    n = 30
    bad = int(int_loader(n, 0, 1).sampler.order(0)[2])
    make = lambda rank, world: int_loader(n, rank, world, processes, decode=FailsOn({bad}),  # noqa: E731
                                          on_error="skip", max_failures=3)
    old, states = run_partway(make, 1, [2])
    assert len(old) == 8 and bad not in old and states[0]["skipped"] == [[2, 3]]
    new = []
    for rank in range(4):
        with make(rank, 4) as loader:
            loader.load_state_dict(states[0] if rank == 0 else states)  # one rank's state is all of them
            new.append([ints(batch) for batch in loader])
            assert loader.stats.failures == [], "the skipped sample is not read again"
    check_rest(old + [bad], new, range(n))  # 21 left: 6 per rank, 3 repeats
    assert [len(b) for b in new[3]] == [4, 2]
    with make(2, 4) as loader:  # a state taken mid-rest resumes it
        loader.load_state_dict(states)
        batches = iter(loader)
        first = ints(next(batches))
        state = loader.state_dict()
        batches.close()
    with make(2, 4) as loader:
        loader.load_state_dict(state)
        assert [first, *[ints(batch) for batch in loader]] == new[2]
        assert [ints(b) for b in loader] == fresh_epoch(n, 2, 4, 1, decode=FailsOn({bad}), on_error="skip",
                                                        max_failures=3)


def images(batch):
    pictures, labels = batch
    seen = [identify(image.numpy()) for image in pictures]
    assert [label for label, _ in seen] == labels.tolist()
    return seen


def test_two_ranks_of_tar_shards_resume_on_three(shard_dir):
    def make(rank, world):
        return AsyncLoader(tar_shards(str(shard_dir), shuffle_buffer=6), batch_size=4, decode=ImageDecoder(32),
                           num_threads=2, seed=5, rank=rank, world_size=world)

    everything = [(label, index) for label in range(len(CLASSES)) for index in range(PER_CLASS)]
    old, states = run_partway(make, 2, [1, 2], images)  # 12 delivered, 12 left: 4 per new rank
    new, after = [], []
    for rank in range(3):
        with make(rank, 3) as loader:
            loader.load_state_dict(states)
            new.append([images(batch) for batch in loader])
            after.append([images(batch) for batch in loader])
    check_rest(old, new, everything)
    assert [len(b) for b in new[0]] == [4]
    for rank in range(3):
        with make(rank, 3) as loader:
            loader.set_epoch(1)
            assert after[rank] == [images(batch) for batch in loader], "next epoch: the new world's"
    # 1 batch each from two ranks: 16 left for three ranks, 6 each with 2 repeats
    old, states = run_partway(make, 2, [1, 1], images)
    new = []
    for rank in range(3):
        with make(rank, 3) as loader:
            loader.load_state_dict(states)
            new.append([images(batch) for batch in loader])
    check_rest(old, new, everything)
    assert [len(b) for b in new[2]] == [4, 2]


def test_a_rest_of_a_rest_four_to_two_to_three():
    """A second change of world size in the same epoch: the rest of what the two ranks of the
    first resume left."""
    n = 61
    make = lambda rank, world: int_loader(n, rank, world)  # noqa: E731
    first, states = run_partway(make, 4, [2, 0, 1, 3])
    second, middle = [], []
    for rank, stop in enumerate([1, 2]):
        with make(rank, 2) as loader:
            loader.load_state_dict(states)
            batches = iter(loader)
            for _ in range(stop):
                second += ints(next(batches))
            middle.append(loader.state_dict())
            batches.close()
    new = []
    for rank in range(3):
        with make(rank, 3) as loader:
            loader.load_state_dict(middle)
            new.append([ints(batch) for batch in loader])
    check_rest(first + second, new, range(n))


def test_one_rank_state_at_another_world_size_is_refused():
    _, states = run_partway(lambda rank, world: int_loader(20, rank, world), 4, [1, 1, 1, 1])
    with int_loader(20, 0, 2) as loader:
        with pytest.raises(ValueError) as refused:
            loader.load_state_dict(states[1])
        assert str(refused.value) == (
            "this state_dict is rank 1's of 4 ranks, and this loader has world_size=2: to resume at another "
            "world size, pass load_state_dict the list of all 4 old ranks' state_dict()s (ranks 0 to 3), "
            "from the same step")
        with pytest.raises(ValueError, match=r"each old rank once: ranks 0 to 3 of world_size=4; got ranks \[0, 1, 3\]"):
            loader.load_state_dict([states[0], states[1], states[3]])
        with pytest.raises(ValueError, match=r"disagree on epoch"):
            loader.load_state_dict([*states[:3], {**states[3], "epoch": 1}])
    with int_loader(20, 0, 2, seed=12) as loader:
        with pytest.raises(ValueError, match="state_dict was saved with seed=11, this loader has 12"):
            loader.load_state_dict(states)
    with int_loader(20, 0, 2, shuffle=False) as loader:
        with pytest.raises(ValueError, match="saved with shuffle=True, this loader has False"):
            loader.load_state_dict(states)


def test_a_list_at_the_same_world_size_resumes_this_rank():
    make = lambda rank, world: int_loader(30, rank, world)  # noqa: E731
    old, states = run_partway(make, 2, [1, 3])
    for rank in range(2):
        with make(rank, 2) as single, make(rank, 2) as listed:
            single.load_state_dict(states[rank])
            listed.load_state_dict(states)
            assert [ints(b) for b in listed] == [ints(b) for b in single]
            assert "elastic" not in listed.state_dict()


@pytest.mark.parametrize("processes", MODES)
def test_rank_0s_state_alone_resumes_every_rank_at_the_same_world_size(processes):
    """What a checkpoint saved on rank 0 alone gives (Lightning, Accelerate, ``if rank == 0:
    torch.save(...)``): ranks in step stand at the same positions of their own orders."""
    whole = []
    for rank in range(2):
        with int_loader(26, rank, 2, processes) as loader:
            loader.set_epoch(3)
            whole.append([ints(batch) for batch in loader])
    with int_loader(26, 0, 2, processes) as loader:
        loader.set_epoch(3)
        batches = iter(loader)
        head = [ints(next(batches)) for _ in range(2)]
        saved = loader.state_dict()
        del batches
    assert head == whole[0][:2] and saved["in_step"]
    for rank in range(2):
        with int_loader(26, rank, 2, processes) as loader:
            loader.load_state_dict(saved)
            assert [ints(batch) for batch in loader] == whole[rank][2:], f"rank {rank} goes on where it stood"


def test_a_state_of_ranks_that_may_have_moved_apart_names_the_list_form():
    """With on_error="skip" each rank's positions are its own: another rank's state is refused,
    naming how to gather every rank's; the rank whose state it is resumes (no collective)."""
    with int_loader(20, 0, 2, decode=FailsOn({3}), on_error="skip", max_failures=5) as loader:
        batches = iter(loader)
        next(batches)
        saved = loader.state_dict()
        del batches
    assert not saved["in_step"]
    with int_loader(20, 1, 2, decode=FailsOn({3}), on_error="skip", max_failures=5) as loader:
        with pytest.raises(ValueError, match=r"rank 0's of 2, and this loader is rank 1: .*list of all 2"
                                             r".*all_gather_object"):
            loader.load_state_dict(saved)
    with int_loader(20, 0, 2, decode=FailsOn({3}), on_error="skip", max_failures=5) as loader:
        loader.load_state_dict(saved)
        assert len(list(loader)) == len(loader) - 1
