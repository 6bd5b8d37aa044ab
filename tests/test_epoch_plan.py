"""The driver's plan of an epoch run (``epoch/plan.py``) as logic: which positions go into which
batch, what replaces a skipped sample, the failure budget, ``drop_last``'s rest, DDP's batch
quota and a resume's done and skipped positions. Fed positions and failures: no thread, no
pipeline, no clock (the end-to-end tests in test_contract.py show the same rules through a loader)."""

from __future__ import annotations

import numpy as np
import pytest

from asyncload import SampleError, TooManyFailures
from asyncload.epoch.plan import EpochPlan, failure_limit
from asyncload.order.epoch_size import EpochSize
from asyncload.order.positions import Positions
from asyncload.stats.loader_stats import LoaderStats


def plan(items=10, batch_size=4, drop_last=False, world_size=1, skip=True, max_failures=100, done=(), skipped=(),
         batches_done=0, order=None) -> EpochPlan:
    """A plan over one rank's ``items`` positions (the order: the positions themselves, unless
    given)."""
    size = EpochSize(items * world_size, world_size, batch_size, drop_last)
    order = np.arange(items) if order is None else order
    return EpochPlan(order, Positions(done), size, batches_done, skip, max_failures, LoaderStats(),
                     Positions(skipped) if skipped else None, epoch=3, rank=0)


def failure(position: int) -> SampleError:
    return SampleError(position, "decode", ValueError(f"sample {position} is corrupt"))


def batches(p: EpochPlan) -> list[list[int]]:
    """Every batch the plan hands out from here, with no failure."""
    out, number = [], 0
    while positions := p.take_batch(number)[0]:
        out.append(positions)
        number += 1
    return out


def test_batches_take_the_next_positions_and_the_last_is_short():
    assert batches(plan()) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_drop_last_keeps_the_short_rest_to_replace_skipped_samples():
    p = plan(drop_last=True)
    assert p.take_batch(0) == ([0, 1, 2, 3], [])
    assert p.record(1, failure(1)) is None  # skipped
    assert p.replacement() == (4, False)  # the next position: later batches move on by one
    assert batches(p) == [[5, 6, 7, 8]]  # one position left: no short batch, it stays
    assert p.replacement() == (9, False)  # and replaces the next skipped sample
    assert p.replacement() == (None, False)  # none left: the batch that skips is dropped


def test_a_skipped_sample_is_replaced_by_the_next_position():
    p = plan()
    assert p.take_batch(0)[0] == [0, 1, 2, 3]
    assert p.record(2, failure(2)) is None
    assert p.replacement() == (4, False)
    assert batches(p) == [[5, 6, 7, 8], [9]]


def test_the_failure_budget_spans_the_epoch_and_a_fraction_counts_samples():
    p = plan(max_failures=2)
    assert p.record(0, failure(0)) is None and p.record(1, failure(1)) is None
    assert p.failures_left() == 0
    error = p.record(2, failure(2))
    assert isinstance(error, TooManyFailures) and len(p.failures) == 3
    assert failure_limit(0.1, 55) == 5 and failure_limit(3, 55) == 3


def test_without_skipping_the_first_failure_is_the_error_its_batch_raises_with_epoch_and_rank():
    p = plan(skip=False)
    error = failure(5)
    assert p.record(5, error) is error and (error.epoch, error.rank) == (3, 0)
    assert [f.item for f in p.stats.failures] == [5]


def test_a_ddp_quota_repeats_from_the_start_passing_over_failed_positions():
    """Two ranks of 5 samples in batches of 2: every rank hands out 3 batches (the last of 1),
    whatever fails: once the cursor runs out, positions repeat from the start of the order."""
    p = plan(items=5, batch_size=2, world_size=2)
    assert (p.quota.count, p.quota.last_size) == (3, 1)
    assert p.take_batch(0) == ([0, 1], [])
    assert p.record(1, failure(1)) is None
    assert p.replacement() == (2, False)
    assert p.take_batch(1) == ([3, 4], [])
    assert p.record(3, failure(3)) is None
    assert p.replacement() == (0, True)  # the cursor is out: a repeat
    assert p.take_batch(2) == ([2], [2])  # 0 is taken, 1 failed: the next repeat
    assert p.take_batch(3) == ([], [])  # the quota is met


def test_a_repeat_that_fails_again_is_not_counted_twice():
    p = plan(items=2, batch_size=2, world_size=2, max_failures=1)
    assert p.record(0, failure(0)) is None
    assert p.record(0, failure(0)) is None and len(p.failures) == 1 and p.failures_left() == 0


def test_a_run_whose_every_sample_fails_still_ends():
    """With a quota, repeats make one pass over the order: a run where everything fails ends
    instead of repeating for ever."""
    p = plan(items=3, batch_size=2, world_size=2)
    taken = []
    for number in range(p.quota.count):
        positions, _ = p.take_batch(number)
        for position in positions:
            assert p.record(position, failure(position)) is None
            while (replacement := p.replacement())[0] is not None:
                taken.append(replacement[0])
                assert p.record(replacement[0], failure(replacement[0])) is None
    # 2 from the cursor, then 1 repeated (0 had failed); 1 fails again as its batch's own: no
    # more repeats, and the second batch finds none.
    assert taken == [2, 1] and p.replacement() == (None, False)


@pytest.mark.parametrize("skip", [True, False])
def test_a_resume_hands_out_the_rest_and_keeps_what_it_skipped_on_the_budget(skip):
    """Positions 0-3 were delivered and 5 was skipped before the resume: the rest starts at 4,
    passes over 5, and 5 counts against the epoch's budget."""
    p = plan(done=[[0, 4]], skipped=[[5, 6]], max_failures=2, skip=skip)
    assert p.undelivered().tolist() == [4, 6, 7, 8, 9]
    assert batches(p) == [[4, 6, 7, 8], [9]]
    assert p.failures_left() == 1


def test_the_plan_hands_out_source_indices_of_its_order():
    order = np.array([7, 3, 9, 1, 0])
    p = plan(items=5, batch_size=2, order=order, done=[[0, 2]])
    assert p.undelivered().tolist() == [9, 1, 0]
    assert batches(p) == [[2, 3], [4]]  # positions; the driver reads order[positions]
