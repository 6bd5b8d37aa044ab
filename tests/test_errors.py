"""Failures: the error a user gets, the skip policy and its failure budget."""

import pickle

import numpy as np
import pytest

from asyncload import AsyncLoader, SampleError, TooManyFailures


def loader_with_bad(bad: set[int], n=30, **kwargs) -> AsyncLoader:
    """Items are integers; those in ``bad`` fail to decode."""

    def decode(i):
        if i in bad:
            raise ValueError(f"item {i} is corrupt")
        return np.full(2, i, np.int64)

    kwargs.setdefault("batch_size", 4)
    kwargs.setdefault("on_error", "skip")
    return AsyncLoader(list(range(n)), read=False, decode=decode, **kwargs)


def rows(batches) -> list[int]:
    return [int(row[0]) for batch in batches for row in batch]


class Corrupt:
    """A decode that fails for the items in ``bad`` (module level: a child process finds it)."""

    def __init__(self, bad: set[int]) -> None:
        self.bad = set(bad)

    def __call__(self, i):
        if i in self.bad:
            raise ValueError(f"item {i} is corrupt")
        return np.full(2, i, np.int64)


def test_sample_error_names_item_stage_and_cause_and_pickles():
    error = SampleError("s3://b/k.jpg", "read", FileNotFoundError("no such key"))
    assert str(error) == "sample 's3://b/k.jpg' failed at read: FileNotFoundError: no such key"
    assert (error.epoch, error.rank) == (None, None), "not recorded yet"
    error.epoch, error.rank = 3, 1
    again = pickle.loads(pickle.dumps(error))
    assert (again.item, again.stage, str(again)) == (error.item, error.stage, str(error))
    assert (again.epoch, again.rank) == (3, 1), "where it failed crosses to another process"
    too_many = pickle.loads(pickle.dumps(TooManyFailures([error], 0)))
    assert (too_many.epoch, too_many.rank) == (3, 1) and too_many.failures[0].epoch == 3
    assert str(too_many).startswith("1 samples failed, more than max_failures=0 in epoch 3 on rank 1: 's3://b/k.jpg'")


@pytest.mark.parametrize("processes", [0, 2])
def test_each_failure_recorded_says_its_epoch(processes):
    """stats.failures spans epochs while max_failures counts one: each record says its epoch."""
    with AsyncLoader(list(range(12)), batch_size=4, shuffle=False, read=False, decode=Corrupt({5}), on_error="skip",
                     max_failures=1, processes=processes) as loader:
        for epoch in (0, 1):
            loader.set_epoch(epoch)
            assert sorted(rows(loader)) == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11]
    assert [(f.item, f.epoch, f.rank) for f in loader.stats.failures] == [(5, 0, None), (5, 1, None)]
    assert str(loader.stats.failures[1]) == "5 failed at decode in epoch 1: ValueError: item 5 is corrupt"


@pytest.mark.parametrize("processes", [0, 2])
def test_a_sample_error_raised_says_its_epoch(processes):
    with AsyncLoader(list(range(8)), batch_size=4, shuffle=False, read=False, decode=Corrupt({5}),
                     processes=processes) as loader:
        loader.set_epoch(4)
        with pytest.raises(SampleError, match="sample 5 failed at decode: ValueError: item 5 is corrupt") as caught:
            list(loader)
    assert (caught.value.epoch, caught.value.rank) == (4, None)


@pytest.mark.parametrize("processes", [0, 2])
def test_each_failure_recorded_says_its_rank(processes):
    bad = {5}  # on rank 1 of 2 (unshuffled ranks take every other item)
    with AsyncLoader(list(range(12)), batch_size=2, shuffle=False, read=False, decode=Corrupt(bad), on_error="skip",
                     max_failures=1, rank=1, world_size=2, processes=processes) as loader:
        for epoch in (0, 1):
            loader.set_epoch(epoch)
            assert len(list(loader)) == len(loader)
    assert [(f.item, f.epoch, f.rank) for f in loader.stats.failures] == [(5, 0, 1), (5, 1, 1)]
    assert str(loader.stats.failures[0]) == "5 failed at decode in epoch 0 on rank 1: ValueError: item 5 is corrupt"


@pytest.mark.parametrize("shuffle", [False, True])
def test_skip_delivers_every_good_sample_once_in_full_batches(shuffle):
    bad = {3, 4, 17}
    with loader_with_bad(bad, shuffle=shuffle, max_failures=10, prefetch=1) as loader:
        batches = list(loader)
    assert sorted(rows(batches)) == sorted(set(range(30)) - bad)
    assert [len(b) for b in batches] == [4] * 6 + [3]
    assert sorted(f.item for f in loader.stats.failures) == sorted(bad)
    assert {f.stage for f in loader.stats.failures} == {"decode"}
    assert all("is corrupt" in f.error for f in loader.stats.failures)


def test_near_the_end_of_an_epoch_a_batch_in_flight_may_come_out_short():
    """Once the last batch has taken the last items, a failure in a batch still in flight has no
    replacement left: that batch comes out one shorter. Everything else holds."""
    bad = {3, 4, 17, 28}
    with loader_with_bad(bad, shuffle=True, max_failures=10, prefetch=4) as loader:
        batches = list(loader)
    assert sorted(rows(batches)) == sorted(set(range(30)) - bad)
    assert all(len(b) == 4 for b in batches[:-4]) and sum(map(len, batches)) == 26


def test_skip_fills_the_slot_with_the_next_item_not_yet_in_a_batch():
    # prefetch=1: only the first batch is in flight when item 1 fails, so item 4 replaces it
    with loader_with_bad({1}, n=12, shuffle=False, max_failures=5, prefetch=1) as loader:
        batches = list(loader)
    assert [sorted(b[:, 0].tolist()) for b in batches] == [[0, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11]]


def test_skip_when_the_first_sample_fails():
    with loader_with_bad({0}, n=8, shuffle=False, max_failures=5) as loader:
        assert sorted(rows(loader)) == list(range(1, 8))


def test_a_failure_with_nothing_left_to_replace_it_shortens_the_last_batch():
    with loader_with_bad({9}, n=10, shuffle=False, max_failures=5) as loader:
        batches = list(loader)
    assert [len(b) for b in batches] == [4, 4, 1]
    assert sorted(rows(batches)) == [0, 1, 2, 3, 4, 5, 6, 7, 8]


def test_a_hole_in_the_middle_of_the_last_batch_is_closed():
    with loader_with_bad({8, 9}, n=11, shuffle=False, max_failures=5) as loader:
        batches = list(loader)
    assert sorted(rows(batches)) == [0, 1, 2, 3, 4, 5, 6, 7, 10]
    assert len(batches[-1]) == 1


def test_failure_budget_as_a_count():
    with loader_with_bad({2, 5, 6}, max_failures=2, shuffle=False) as loader:
        with pytest.raises(TooManyFailures) as caught:
            list(loader)
    assert caught.value.item == [2, 5, 6]
    assert "3 samples failed, more than max_failures=2" in str(caught.value)
    assert "ValueError: item 5 is corrupt" in str(caught.value)
    assert isinstance(caught.value, SampleError)


def test_failure_budget_as_a_fraction():
    with loader_with_bad({1, 2}, n=100, max_failures=0.015) as loader:  # 1.5 % of 100: one may fail
        with pytest.raises(TooManyFailures):
            list(loader)
    with loader_with_bad({1, 2}, n=100, max_failures=0.02) as loader:
        assert len(rows(loader)) == 98


def test_default_budget_stops_a_broken_dataset():
    with loader_with_bad(set(range(50)), n=60, shuffle=False) as loader:
        with pytest.raises(TooManyFailures):
            list(loader)


def test_raise_mode_does_not_skip():
    with loader_with_bad({5}, on_error="raise", shuffle=False) as loader:
        with pytest.raises(SampleError, match="sample 5 failed at decode: ValueError: item 5 is corrupt"):
            list(loader)


def test_resume_after_skips_delivers_the_rest_once():
    bad = {2, 13}
    with loader_with_bad(bad, n=40, seed=5, max_failures=5) as loader:
        batches = iter(loader)
        head = [next(batches).clone() for _ in range(3)]
        state = loader.state_dict()
        del batches
    with loader_with_bad(bad, n=40, seed=5, max_failures=5) as resumed:
        resumed.load_state_dict(state)
        rest = list(resumed)
    assert sorted(rows(head) + rows(rest)) == sorted(set(range(40)) - bad)


@pytest.mark.parametrize("drop_last", [False, True])
def test_with_several_ranks_skips_keep_len_batches_by_repeating_samples(drop_last):
    """A rank whose samples fail must still deliver len(loader) batches, or DDP hangs at the end
    of the epoch: rows left without an item are filled with the rank's first good samples again,
    as DistributedSampler pads."""
    bad = {0, 2, 4, 6, 8}  # all on rank 0 of 2 (unshuffled ranks take every other item)
    counts = []
    for rank in range(2):
        with loader_with_bad(bad, n=24, shuffle=False, drop_last=drop_last, max_failures=10,
                             rank=rank, world_size=2) as loader:
            batches = list(loader)
            counts.append((len(batches), len(loader)))
            if rank == 0:
                got = rows(batches)
                assert set(got) == set(range(0, 24, 2)) - bad  # every good sample of the rank
                assert len(got) == 12 and len(got) - len(set(got)) == 5  # five repeats fill the rows
                repeated = sorted(v for v in set(got) if got.count(v) == 2)
                assert repeated == [10, 12, 14, 16, 18]  # the rank's first good samples again
                assert len(loader.stats.failures) == 5
    assert counts == [(3, 3), (3, 3)]


def test_one_rank_alone_delivers_each_good_sample_once_without_repeats():
    with loader_with_bad({0, 2}, n=12, shuffle=False, max_failures=5) as loader:
        batches = list(loader)
    assert sorted(rows(batches)) == [1, 3, 4, 5, 6, 7, 8, 9, 10, 11] and len(batches) == 3


def test_resume_with_several_ranks_still_delivers_len_batches():
    kwargs = dict(n=24, shuffle=False, max_failures=10, rank=0, world_size=2, prefetch=1)
    with loader_with_bad({6, 8, 10}, **kwargs) as loader:
        iterator = iter(loader)
        first = next(iterator)
        state = loader.state_dict()
        iterator.close()
    assert state["batches"] == 1
    with loader_with_bad({6, 8, 10}, **kwargs) as loader:
        loader.load_state_dict(state)
        rest = list(loader)
    assert len(rest) == 2 and len(rows([first, *rest])) == 12


def test_the_failure_budget_spans_a_resumed_epoch():
    """Two failures before the checkpoint and one after exceed max_failures=2 as in one run;
    the skipped samples are not read again after the resume."""
    bad = {1, 2, 25}
    decoded = []

    def decode(i):
        decoded.append(i)
        if i in bad:
            raise ValueError(f"item {i} is corrupt")
        return np.full(2, i, np.int64)

    kwargs = dict(batch_size=4, shuffle=False, read=False, on_error="skip", max_failures=2, prefetch=1)
    with AsyncLoader(list(range(30)), decode=decode, **kwargs) as loader:
        iterator = iter(loader)
        head = [next(iterator) for _ in range(2)]
        state = loader.state_dict()
        iterator.close()
    assert sorted(rows(head)) == [0, 3, 4, 5, 6, 7, 8, 9] and state["skipped"] == [[1, 3]]
    decoded.clear()
    with AsyncLoader(list(range(30)), decode=decode, **kwargs) as resumed:
        resumed.load_state_dict(state)
        with pytest.raises(TooManyFailures):
            list(resumed)
    assert not {1, 2} & set(decoded), "skipped samples are not read again"


def test_a_failed_first_sample_in_the_only_batch_loses_no_other_sample():
    """The epoch's first sample teaches the layout; when it fails and the epoch has nothing left
    to replace it, the rest of its batch is still delivered (it used to end the epoch empty)."""
    def decode(i):
        if i == 0:
            raise ValueError("corrupt")
        return np.full(2, i, np.int64)

    with AsyncLoader(list(range(10)), batch_size=16, shuffle=False, read=False, decode=decode,
                     on_error="skip", max_failures=1) as loader:
        batches = [b[:, 0].tolist() for b in loader]
    assert batches == [[9, *range(1, 9)]], "the rest, the last row moved into the hole as for any skip"
    assert [f.item for f in loader.stats.failures] == [0]


def test_a_cause_of_many_lines_is_shown_by_its_first_and_kept_whole():
    cause = OSError("\n\n  HTTP 500 from storage  \nTraceback of the server:\n  frame 1\n  frame 2")
    error = SampleError("s3://b/k.jpg", "read", cause)
    assert str(error) == "sample 's3://b/k.jpg' failed at read: OSError: HTTP 500 from storage"
    assert error.__cause__ is cause and "frame 2" in str(error.__cause__)


def test_a_long_cause_keeps_its_start_and_its_end():
    """A client's chain of causes ends with the deepest one: the middle is what goes."""
    cause = OSError("GET s3://b/k.jpg failed: " + "context " * 100 + "- because: Connection reset by peer")
    message = str(SampleError("s3://b/k.jpg", "read", cause))
    assert len(message) < 300 and message.endswith("because: Connection reset by peer"), message
    assert "OSError: GET s3://b/k.jpg failed: context" in message and " ... " in message
