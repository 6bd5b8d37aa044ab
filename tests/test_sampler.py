import numpy as np
import pytest

from asyncload.order.sampler import EpochSampler


def sampler(n=10, batch_size=3, shuffle=True, seed=0, drop_last=False, rank=0, world_size=1):
    return EpochSampler(n, batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last, rank=rank, world_size=world_size)


def test_unshuffled_order_is_the_source_order():
    batches = sampler(shuffle=False).batches(0)
    assert [b.tolist() for b in batches] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]


def test_shuffle_depends_on_seed_and_epoch_only():
    a, b = sampler(seed=5), sampler(seed=5)
    assert a.order(3).tolist() == b.order(3).tolist()
    assert a.order(3).tolist() != a.order(4).tolist()
    assert sampler(seed=6).order(3).tolist() != a.order(3).tolist()
    assert sorted(a.order(3).tolist()) == list(range(10))


def test_shuffle_is_the_same_on_every_machine():
    # PCG64 seeded by SeedSequence([seed, epoch]) is specified by NumPy, not by the platform.
    assert sampler(n=8, seed=0).order(0).tolist() == np.random.default_rng([0, 0]).permutation(8).tolist()


@pytest.mark.parametrize("drop_last, expected_batches, expected_sizes", [(False, 4, [3, 3, 3, 1]), (True, 3, [3, 3, 3])])
def test_drop_last(drop_last, expected_batches, expected_sizes):
    s = sampler(drop_last=drop_last)
    assert len(s) == expected_batches
    assert [len(b) for b in s.batches(0)] == expected_sizes


@pytest.mark.parametrize("n, world_size", [(10, 3), (12, 4), (7, 2), (2, 3)])
def test_shards_are_disjoint_cover_and_equal(n, world_size):
    shards = [sampler(n=n, rank=r, world_size=world_size).order(1) for r in range(world_size)]
    assert len({len(s) for s in shards}) == 1, "every rank must get the same number of samples"
    assert len({len(sampler(n=n, rank=r, world_size=world_size)) for r in range(world_size)}) == 1
    together = np.concatenate(shards)
    assert set(together.tolist()) == set(range(n)), "shards must cover the dataset"
    if n % world_size == 0:
        assert len(together) == n, "shards must be disjoint"
    else:
        assert len(together) == world_size * -(-n // world_size)  # padded like DistributedSampler


def test_drop_last_with_shards_drops_the_uneven_tail():
    shards = [sampler(n=10, rank=r, world_size=3, drop_last=True).order(0) for r in range(3)]
    together = np.concatenate(shards).tolist()
    assert len(together) == 9 and len(set(together)) == 9


class Key:
    """A source item with the default repr, which holds a memory address."""


def test_the_source_digest_is_the_same_in_another_process():
    """A resume happens in a new process: the digest of the same source must not change there
    (a default repr holds a memory address), nor between a list and a tuple of the same items."""
    import subprocess
    import sys

    from asyncload.order.sampler import source_digest

    code = ("from tests.test_sampler import Key; from asyncload.order.sampler import source_digest; "
            "print(source_digest([(f's3://b/{i}', i) for i in range(100)]), source_digest([Key() for _ in range(9)]))")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    here = [source_digest(tuple((f"s3://b/{i}", i) for i in range(100))), source_digest([Key() for _ in range(9)])]
    assert other == here
    assert source_digest([f"s3://b/{i}" for i in range(100)]) != source_digest([f"s3://b/{i}" for i in range(1, 101)])
