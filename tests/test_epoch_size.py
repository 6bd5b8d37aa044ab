"""EpochSize: the one owner of the epoch's arithmetic, against DistributedSampler and by hand."""

import math

import numpy as np
import pytest
from torch.utils.data.distributed import DistributedSampler

from asyncload.order.epoch_size import BatchQuota, EpochSize
from asyncload.order.sampler import EpochSampler


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("items,world_size", [(0, 1), (1, 1), (10, 1), (10, 3), (11, 4), (3, 4), (64, 8)])
def test_dealing_is_distributed_samplers(items, world_size, drop_last):
    """Each rank's part, its length and the padding are DistributedSampler's (shuffle=False)."""
    size = EpochSize(items, world_size, batch_size=4, drop_last=drop_last)
    order = np.arange(items)
    for rank in range(world_size):
        theirs = list(DistributedSampler(range(items), world_size, rank, shuffle=False, drop_last=drop_last)) if items else []
        assert size.deal(order, rank).tolist() == theirs
        assert size.per_rank == len(theirs)
    assert size.padding == (0 if drop_last or not items else size.per_rank * world_size - items)


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("per_rank,batch_size", [(0, 4), (1, 4), (4, 4), (9, 4), (10, 3)])
def test_batches_and_the_last_batch(per_rank, batch_size, drop_last):
    size = EpochSize(per_rank, 1, batch_size, drop_last)
    batches = per_rank // batch_size if drop_last else math.ceil(per_rank / batch_size)
    assert size.batches == batches
    if batches:
        assert size.last_size == (batch_size if drop_last else per_rank - (batches - 1) * batch_size)
    assert size.delivered == min(per_rank, batches * batch_size)
    assert size.smallest_batch == (batch_size if drop_last else 1)


def test_the_quota_is_for_several_ranks_only():
    assert EpochSize(10, 1, 4, False).quota(0) is None
    assert EpochSize(10, 2, 4, False).quota(1) == BatchQuota(count=1, last_size=1)  # 5 per rank: 4 + 1
    assert EpochSize(10, 2, 4, True).quota(0) == BatchQuota(count=1, last_size=4)
    assert EpochSize(10, 2, 4, True).keeps_short_rest(None) and not EpochSize(10, 2, 4, True).keeps_short_rest(
        BatchQuota(1, 4))


def test_a_stretch_is_contiguous_and_as_long_as_a_dealt_part():
    size = EpochSize(10, 3, 2, drop_last=False)  # 4 per rank, 2 repeats from the start
    parts = [size.stretch(np.arange(10), rank).tolist() for rank in range(3)]
    assert parts == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]


def test_the_sampler_reads_its_size():
    sampler = EpochSampler(11, 4, shuffle=False, seed=0, drop_last=False, rank=1, world_size=4)
    assert (sampler.samples_per_rank, len(sampler)) == (sampler.size.per_rank, sampler.size.batches) == (3, 1)
    assert sampler.size.of(11, 2).per_rank == 6
