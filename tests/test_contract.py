"""The loader's contract, the same with ``processes=0`` and ``processes=2``: one driver decides
every rule and one pipeline moves the samples, so no behaviour may differ by mode.

Samples here are their own source index (``read=False``, a decode that returns the index), so a
batch says exactly which samples it holds. What the children run is defined at module level:
spawn finds it by name. Each case with ``processes=2`` starts two children (a few seconds).
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from asyncload import AsyncLoader, TooManyFailures
from asyncload.order.positions import Positions
from tests.conftest import asyncload_threads, wait_until
from tests.decoders import FailsOn, as_array
from tests.support.gate import Gate
from tests.switching import force_switch

# "switch": processes=None, made to move from this process to two children after the second
# batch (tests/switching.py): both states of the default's switch, and the switch itself.
MODES = [0, 2, "switch"]


@pytest.fixture(autouse=True)
def switching(request, monkeypatch):
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("processes") == "switch":
        force_switch(monkeypatch)


# ----- what the pipelines run -----


class LoggedRead:
    """A read that appends each index it is asked for to a file (from any process)."""

    def __init__(self, path):
        self.path = str(path)

    def __call__(self, index):
        with open(self.path, "a") as log:
            log.write(f"{index}\n")
        return index


class StallsFrom:
    """A synchronous read that hangs from index ``first`` on (a stuck mount, a dead server) until
    the test opens ``gate`` (60 s at most: a bound, so that a forgotten one ends by itself), then
    marks itself done: a close that waited for it would find it done."""

    def __init__(self, first, gate: Gate):
        self.first = first
        self.gate = gate

    def __call__(self, index):
        if index >= self.first:
            self.gate.wait(index, seconds=60)
            self.gate.mark_done(index)
        return index


def reads(path: Path) -> list[int]:
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def intervals(positions: list[int]) -> list[list[int]]:
    done = Positions()
    done.add(positions)
    return done.intervals()


def batches(loader) -> list[list[int]]:
    return [batch[:, 0].tolist() for batch in loader]


def loader_for(n, processes, **kwargs):
    kwargs = {"batch_size": 4, "read": False, "decode": as_array, "num_threads": 2, **kwargs}
    return AsyncLoader(list(range(n)), processes=None if processes == "switch" else processes, **kwargs)


# ----- the contract -----


@pytest.mark.parametrize("processes", MODES)
def test_batches_follow_the_order_and_deliver_every_sample_once(processes):
    with loader_for(50, processes, batch_size=8, seed=5) as loader:
        expected = loader.sampler.order(0).tolist()
        got = batches(loader)
        assert [len(b) for b in got] == [8] * 6 + [2]
        assert sum(got, []) == expected, "in the sampler's order, each sample once"
        second = batches(loader)
        assert sorted(sum(second, [])) == list(range(50))
        figures = loader.stats.as_dict()
        assert figures["samples"] == 100 and figures["batches"] == 14


@pytest.mark.parametrize("processes", MODES)
def test_drop_last_with_a_skip_hands_out_only_full_batches(processes):
    """A skipped sample the epoch has no replacement for leaves its batch short: with drop_last
    that batch is dropped, as a short last batch is (it was handed out with processes=2)."""
    with loader_for(16, processes, batch_size=8, shuffle=False, drop_last=True, on_error="skip",
                    decode=FailsOn({5}), max_failures=3) as loader:
        got = batches(loader)
    assert got == [list(range(8, 16))]
    assert [str(failure.item) for failure in loader.stats.failures] == ["5"]


@pytest.mark.parametrize("processes", MODES)
def test_a_batch_whose_every_row_fails_is_not_handed_out_empty(processes):
    with loader_for(10, processes, shuffle=False, on_error="skip", decode=FailsOn({8, 9}), max_failures=5) as loader:
        got = batches(loader)
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7]], "no batch of 0 rows"


@pytest.mark.parametrize("processes", MODES)
def test_a_first_batch_that_cannot_be_read_is_skipped_in_the_state_and_not_read_again(processes, tmp_path):
    """No sample of the first batch loads, so the layout is learnt from a later one (the probe):
    the first batch the user gets holds other samples, the state names exactly the four skipped,
    and a resume from it reads none of them again."""
    log = tmp_path / "reads.log"
    options = dict(shuffle=False, on_error="skip", decode=FailsOn(range(4)), read=LoggedRead(log), max_failures=4)
    with loader_for(20, processes, **options) as loader:
        first = next(iter(loader))[:, 0].tolist()
        state = loader.state_dict()
    assert not set(first) & set(range(4)) and len(first) == 4
    assert state["skipped"] == [[0, 4]] and state["delivered"] == intervals(first)
    log.unlink()
    with loader_for(20, processes, **options) as resumed:
        resumed.load_state_dict(state)
        rest = batches(resumed)
        assert not resumed.stats.failures
    assert not set(reads(log)) & set(range(4)), "a skipped sample is not read again"
    assert sorted(first + sum(rest, [])) == list(range(4, 20)), "the rest, each once"


@pytest.mark.parametrize("processes", MODES)
def test_skips_are_in_the_state_and_a_resume_neither_rereads_them_nor_restarts_the_budget(processes, tmp_path):
    log = tmp_path / "reads.log"
    # The second failure (21) lies past what the first pass has under way when its first batch is
    # handed out (4 batches with two children): were it inside, whether it failed before that
    # hand-out, and so exceeded the budget there, would depend on timing.
    options = dict(shuffle=False, on_error="skip", decode=FailsOn({2, 21}), read=LoggedRead(log), prefetch=1)
    with loader_for(24, processes, max_failures=1, **options) as loader:
        iterator = iter(loader)
        first = next(iterator)[:, 0].tolist()
        state = loader.state_dict()
    replacement = first[2]  # the plan's next position: after the window's batches
    assert first == [0, 1, replacement, 3] and replacement >= 4, "sample 2 skipped, its row given the next"
    assert state["skipped"] == [[2, 3]] and state["delivered"] == intervals([0, 1, 3, replacement])
    log.unlink()
    with loader_for(24, processes, max_failures=1, **options) as resumed:
        resumed.load_state_dict(state)
        with pytest.raises(TooManyFailures):  # 21 is the epoch's second failure: over a budget of one
            batches(resumed)
    assert 2 not in reads(log), "a skipped sample is not read again"
    with loader_for(24, processes, max_failures=2, **options) as resumed:
        resumed.load_state_dict(state)
        rest = batches(resumed)
    assert sorted(first + sum(rest, [])) == [i for i in range(24) if i not in (2, 21)], "the rest, each once"


@pytest.mark.parametrize("processes", MODES)
def test_a_resumed_rank_pads_as_the_uninterrupted_run(processes):
    """DDP: ranks deliver equal batch counts, so a rank that skipped samples pads with repeats.
    Resuming at any batch gives the same batches as the run that was never interrupted."""
    if processes == "switch":
        pytest.skip("which position replaces a skip depends on the window (2 batches in this process, 4 with two "
                    "children); this test compares passes that would run in different states of the switch")
    options = dict(batch_size=2, shuffle=True, seed=1, rank=0, world_size=2, on_error="skip", max_failures=5)
    with loader_for(16, processes, **options) as probe:
        order = probe.sampler.order(0)[:8].tolist()
    options["decode"] = FailsOn(order[:2])  # the rank's first batch fails whole: padding comes early
    with loader_for(16, processes, **options) as loader:
        whole = batches(loader)
        assert len(whole) == 4 and all(len(b) == 2 for b in whole)
        for cut in (1, 2, 3):
            loader.set_epoch(0)  # again: a new pass without it is the next epoch
            iterator = iter(loader)
            head = [next(iterator)[:, 0].tolist() for _ in range(cut)]
            state = loader.state_dict()
            del iterator
            with loader_for(16, processes, **options) as resumed:
                resumed.load_state_dict(state)
                assert head + batches(resumed) == whole, f"resumed after batch {cut}"


@pytest.mark.parametrize("processes", MODES)
def test_the_probed_first_sample_is_read_and_decoded_once(processes, tmp_path):
    """A decoder that does not declare its output teaches the layout with the epoch's first
    sample: that sample is then written from the probe, not read again."""
    log = tmp_path / "reads.log"
    with loader_for(12, processes, shuffle=False, read=LoggedRead(log)) as loader:
        assert sum(batches(loader), []) == list(range(12))
    assert sorted(reads(log)) == list(range(12))


@pytest.mark.parametrize("processes", MODES)
def test_a_source_whose_samples_all_fail_stops_at_its_budget_while_learning_the_layout(processes, tmp_path):
    """The layout is learnt from the first sample that loads; while none does, each failure is
    on the budget, so a source of bad samples raises TooManyFailures after max_failures + 1
    reads, not after reading the whole epoch one at a time."""
    log = tmp_path / "reads.log"
    with AsyncLoader(list(range(2000)), batch_size=8, shuffle=False, read=LoggedRead(log),
                     decode=FailsOn(range(2000)), on_error="skip", max_failures=5,
                     processes=None if processes == "switch" else processes) as loader:
        with pytest.raises(TooManyFailures, match="6 samples failed, more than max_failures=5"):
            list(loader)
    assert sorted(reads(log)) == list(range(6))


@pytest.mark.parametrize("processes", MODES)
def test_leaving_the_loop_during_stalled_reads_returns_within_seconds(processes, tmp_path):
    """A synchronous read stuck in the user's code cannot be interrupted: closing must not wait
    for it (it took 10 s). Its thread, abandoned, ends by itself when the call returns."""
    gate = Gate(tmp_path / "open")
    loader = loader_for(10_000, processes, batch_size=8, shuffle=False, read=StallsFrom(8, gate),
                        decode=np.asarray, read_timeout=120)
    try:
        iterator = iter(loader)
        assert next(iterator).tolist() == list(range(8))
        assert wait_until(lambda: gate.waiting(8), timeout=60), "the read of 8 is out and stuck"
        iterator.close()  # leaving the loop (a break) must not wait for the stuck reads either
        loader.close()
        # The reads stay stuck until the gate opens below: a close that waited for them would
        # have waited out the gate's 60 s, and found the read of 8 done.
        assert not gate.done(8), "the close waited for the stuck read"
        left = asyncload_threads()
        assert all(thread.name.startswith("asyncload-read") for thread in left), [t.name for t in left]
    finally:
        gate.open()
    assert wait_until(lambda: not asyncload_threads(), timeout=30), "the stuck reads' threads end with their calls"


@pytest.mark.parametrize("processes", MODES)
def test_close_from_another_thread_ends_the_iteration(processes, tmp_path):
    gate = Gate(tmp_path / "open")
    loader = loader_for(10_000, processes, batch_size=8, shuffle=False, read=StallsFrom(8, gate), decode=np.asarray)
    outcome: list = []

    def consume():
        try:
            for _ in loader:
                pass
        except RuntimeError as error:
            outcome.append(error)

    consumer = threading.Thread(target=consume)
    consumer.start()
    try:
        assert wait_until(lambda: gate.waiting(8), timeout=60), "the reads from 8 on are out and stuck"
        loader.close()
        consumer.join(timeout=120)  # a bound against a hang only
        assert not gate.done(8), "close does not wait for the stuck reads (until the gate opens)"
        assert not consumer.is_alive() and "ended" in str(outcome[0])
    finally:
        gate.open()
    assert wait_until(lambda: not asyncload_threads(), timeout=30)


@pytest.mark.parametrize("processes", MODES)
def test_a_pipeline_task_that_fails_outside_any_sample_raises_instead_of_hanging(processes):
    """A fill's task raised (here: the reader cannot build the filesystem for memory:// with a
    bad option, before any row was handed on): its rows would never end, and the loop waited
    for ever. Now the pipeline reports the failure and the loop raises it."""
    with AsyncLoader(["memory://bucket/a.jpg", "memory://bucket/b.jpg"], batch_size=2, shuffle=False,
                     storage_options={"client": "nonsense"},
                     processes=None if processes == "switch" else processes) as loader:
        with pytest.raises(RuntimeError, match="the loader's pipeline failed: ValueError: storage_options.'client'. must"):
            list(loader)
