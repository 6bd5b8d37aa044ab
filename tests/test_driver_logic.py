"""The driver's decisions (``epoch/window.py``) as logic: the window of batches under way, the
hand-out order, a failed row refilled, skip and its failure budget, ``drop_last`` and the short
last batch over ranks, the resume state, and which pipeline fills which rows (``dispatch.py``).
Fed events by hand (a batch assigned, a fill
answered with failures, a batch taken): no thread, no pipeline, no clock. One test compares the
state recorded here with a real loader's, end to end."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from asyncload import AsyncLoader, SampleError, TooManyFailures
from asyncload.backend import window as window_of
from asyncload.epoch.dispatch import Dispatch
from asyncload.epoch.in_flight import InFlight
from asyncload.epoch.plan import EpochPlan
from asyncload.epoch.ledger import EpochLedger
from asyncload.epoch.window import Window
from asyncload.order.epoch_size import EpochSize
from asyncload.pipeline.pipelines import ENDED
from asyncload.stats.loader_stats import LoaderStats
from tests.decoders import FailsOn


def failure(item: int) -> SampleError:
    return SampleError(item, "decode", ValueError(f"sample {item} is corrupt"))


class Run:
    """A driver's window over one rank's part of an epoch, its pipelines played by the test:
    ``assign`` sends the batches the window allows, ``answer`` answers one fill of a batch
    (with the rows that failed), ``hand_out`` takes the next batch as the driver does."""

    def __init__(self, items: int = 12, batch_size: int = 4, window: int = 2, in_order: bool = True,
                 drop_last: bool = False, world_size: int = 1, rank: int = 0, skip: bool = True,
                 max_failures: int | float = 100, ledger: EpochLedger | None = None) -> None:
        size = EpochSize(items, world_size, batch_size, drop_last)
        self.order = size.deal(np.arange(items), rank)  # epoch position -> source index
        self.ledger = ledger or EpochLedger()
        plan = EpochPlan(self.order, self.ledger.done, size, self.ledger.batches, skip, max_failures,
                         LoaderStats(), self.ledger.skipped, self.ledger.repeated, epoch=0,
                         rank=rank if world_size > 1 else None)
        self.window = Window(plan, self.ledger, window, in_order)
        self.fills: list[tuple[int, list[int]]] = []  # (batch number, rows) sent, in order

    def assign(self) -> list[int]:
        """The batches the window lets the driver assign now (their numbers)."""
        numbers = []
        while self.window.wants_batch():
            positions, repeated = self.window.next_positions()
            if not positions:
                break
            batch = self.window.add(positions, None, repeated)
            self._send(batch, list(range(len(positions))))
            numbers.append(batch.number)
        return numbers

    def _send(self, batch, rows: list[int]) -> None:
        batch.pending += 1
        self.fills.append((batch.number, rows))

    def answer(self, number: int, failed_rows: tuple[int, ...] = ()) -> None:
        """One fill of batch ``number`` is done; ``failed_rows``: its rows whose sample failed
        (their source index is named). A row given a replacement goes out again."""
        batch = self.window.batches[number]
        batch.pending -= 1
        self.fills.remove(next(fill for fill in self.fills if fill[0] == number))
        for row in failed_rows:
            if self.window.failed(batch, row, failure(int(self.order[batch.positions[row]]))):
                self._send(batch, [row])

    def hand_out(self) -> list[int] | str | None:
        """The user's next batch if complete: its source indices, or "drop"; None if not ready.
        A batch that raises raises."""
        number = self.window.next_ready()
        if number is None:
            return None
        batch = self.window.take(number)
        verdict, delivered = self.window.verdict(batch)
        if verdict == "raise":
            raise batch.first_error()
        if verdict == "drop":
            self.window.dropped(batch)
            return "drop"
        self.window.handed_out(batch, delivered)
        return self.order[delivered].tolist()

    def epoch(self, failing: frozenset[int] | set[int] = frozenset(), batches: int | None = None) -> list[list[int] | str]:
        """The rest of the epoch (or its next ``batches``), the fills answered oldest first, the
        samples ``failing`` (source indices) failing wherever they land."""
        out: list[list[int] | str] = []
        while len(out) != batches:
            self.assign()
            while self.window.next_ready() is None and self.fills:
                number, rows = self.fills[0]
                positions = self.window.batches[number].positions
                self.answer(number, tuple(row for row in rows if int(self.order[positions[row]]) in failing))
            if self.window.finished:
                return out
            out.append(self.hand_out())
        return out


# ----- the window and the hand-out order -----


def test_the_window_assigns_batches_up_to_its_size_ahead_of_the_user():
    run = Run(items=20, window=2)
    assert run.assign() == [0, 1] and run.assign() == []
    run.answer(0)
    assert run.assign() == [], "a complete batch not taken still counts in the window"
    assert run.hand_out() == [0, 1, 2, 3]
    assert run.assign() == [2]
    assert [n for n, _ in run.fills] == [1, 2], "the fills out"


def test_in_order_a_finished_batch_waits_for_the_one_before_it():
    run = Run(window=2)
    run.assign()
    run.answer(1)
    assert run.window.next_ready() is None and run.hand_out() is None
    run.answer(0)
    assert run.hand_out() == [0, 1, 2, 3] and run.hand_out() == [4, 5, 6, 7]


def test_out_of_order_a_finished_batch_passes_a_slow_one():
    run = Run(window=2, in_order=False)
    run.assign()
    run.answer(1)
    assert run.hand_out() == [4, 5, 6, 7]
    assert run.assign() == [2]
    run.answer(2)
    assert run.hand_out() == [8, 9, 10, 11], "batch 0 is still slow"
    run.answer(0)
    assert run.hand_out() == [0, 1, 2, 3]
    assert run.assign() == [] and run.window.finished, "the plan is used up, nothing under way"
    assert run.ledger.as_state()["delivered"] == [[0, 12]]


def test_a_failed_row_is_refilled_with_the_epochs_next_position_after_the_window():
    run = Run(items=12, window=2)
    run.assign()
    run.answer(0, failed_rows=(1,))
    assert run.fills == [(1, [0, 1, 2, 3]), (0, [1])], "row 1 goes out again"
    assert run.hand_out() is None, "batch 0 waits for its refill"
    run.answer(0)
    assert run.hand_out() == [0, 8, 2, 3]  # 8: the cursor's next, batches 0 and 1 were planned
    run.answer(1)
    assert run.hand_out() == [4, 5, 6, 7]
    assert run.epoch() == [[9, 10, 11]]
    assert run.ledger.as_state() == {"delivered": [[0, 1], [2, 12]], "batches": 3, "skipped": [[1, 2]],
                                       "padded": []}


# ----- skip and its budget -----


def test_the_budget_as_a_count_raises_at_the_failure_past_it_naming_every_failure():
    run = Run(items=16, window=2, max_failures=2)
    run.assign()
    run.answer(0, failed_rows=(0, 1))  # 2 failures: within the budget, replaced by 8 and 9
    run.answer(0)
    run.answer(0)  # each row refilled is a fill of its own
    assert run.hand_out() == [8, 9, 2, 3]
    run.answer(1, failed_rows=(2,))  # the third: batch 1 raises it
    with pytest.raises(TooManyFailures) as raised:
        run.hand_out()
    error = raised.value
    assert error.item == [0, 1, 6] and error.cause.item == 6
    assert str(error).startswith("3 samples failed, more than max_failures=2")
    assert run.ledger.as_state()["skipped"] == [[0, 2]], "the batch raised: its skips are not on the record"


def test_the_budget_as_a_fraction_counts_the_epochs_samples():
    run = Run(items=12, window=2, max_failures=0.25)  # 3 of 12
    # 0 -> 8 and 5 -> 9 (the cursor's next after two batches); 10 finds none left: a hole
    assert run.epoch(failing={0, 5, 10}) == [[8, 1, 2, 3], [4, 9, 6, 7], [11]]
    with pytest.raises(TooManyFailures) as raised:
        Run(items=12, window=2, max_failures=0.25).epoch(failing={0, 5, 10, 11})
    assert raised.value.item[-1] == 11 and len(raised.value.item) == 4


def test_without_skip_the_first_failure_raises_naming_its_sample():
    run = Run(skip=False)
    run.assign()
    run.answer(0)
    run.answer(1, failed_rows=(3,))
    assert run.hand_out() == [0, 1, 2, 3]
    with pytest.raises(SampleError) as raised:
        run.hand_out()
    assert type(raised.value) is SampleError and raised.value.item == 7 and "sample 7 is corrupt" in str(raised.value)


# ----- drop_last and the short last batch, over ranks -----


@pytest.mark.parametrize("rank", [0, 1])
def test_the_short_last_batch_is_delivered_without_drop_last_and_dropped_with_it(rank):
    """21 samples, 2 ranks, batches of 4: 11 each (rank 1's padded with sample 0) in 4+4+3;
    with drop_last, 10 each in 4+4."""
    whole = Run(items=21, world_size=2, rank=rank).epoch()
    assert [len(b) for b in whole] == [4, 4, 3]
    assert sum(whole, []) == list(range(rank, 21, 2)) + ([0] if rank else [])
    dropped = Run(items=21, world_size=2, rank=rank, drop_last=True).epoch()
    assert dropped == [list(range(rank, 8, 2)), list(range(8 + rank, 16, 2))]


def test_drop_last_in_one_process_fills_skips_from_the_short_rest_then_drops_a_batch_left_short():
    run = Run(items=9, window=2, drop_last=True)  # batches 0-3, 4-7; 8 kept back for a skip
    assert run.epoch(failing={1, 5}) == [[0, 8, 2, 3], "drop"]
    assert run.ledger.as_state() == {"delivered": [[0, 1], [2, 4], [8, 9]], "batches": 1,
                                       "skipped": [[1, 2], [5, 6]], "padded": []}


def test_with_ranks_the_quota_is_met_by_repeats_whatever_fails():
    """Every rank delivers len(loader) batches of the same sizes even when samples fail (DDP):
    once the rank's part is used up, positions repeat from its start."""
    run = Run(items=16, world_size=2, rank=1, window=2)  # rank 1: 1, 3, ..., 15 in 4 + 4
    assert run.epoch(failing={3}) == [[1, 1, 5, 7], [9, 11, 13, 15]]  # both batches planned: 3 -> a repeat
    assert run.ledger.as_state()["padded"] == [[0, 1]]


# ----- the resume state -----


def test_a_resume_from_the_state_after_k_batches_delivers_the_rest_of_the_uninterrupted_run():
    whole = Run(items=20, window=2).epoch(failing={2, 9})
    first = Run(items=20, window=2)
    first.assign()
    first.answer(0, failed_rows=(2,))
    first.answer(0)
    assert first.hand_out() == whole[0]
    rest = Run(items=20, window=2, ledger=EpochLedger.from_state(first.ledger.as_state(), 4)).epoch(failing={9})
    assert [whole[0], *rest] == whole


@pytest.mark.parametrize("processes", [0, 2])
@pytest.mark.parametrize("k", [1, 5])
def test_the_state_after_k_batches_is_the_one_a_real_loader_records(processes, k):
    """A sample fails in the first batch; the batches and the state after ``k`` of them here and
    through a real loader (same window: ``prefetch``, or two batches per child) are the same."""
    logic = Run(items=24, window=window_of(2, processes))
    handed = logic.epoch(failing={1}, batches=k)
    with AsyncLoader(list(range(24)), batch_size=4, read=False, decode=FailsOn({1}), on_error="skip", max_failures=5,
                     shuffle=False, prefetch=2, processes=processes) as loader:
        got = []
        for batch in loader:
            got.append(batch[:, 0].tolist())
            if len(got) == k:
                break
        state = loader.state_dict()
    assert got == handed
    assert {key: state[key] for key in ("delivered", "batches", "skipped", "padded")} == logic.ledger.as_state()


@pytest.mark.parametrize("case", [
    dict(items=16, world_size=2, rank=1, failing={3}),  # rank 1's part used up: a repeat fills the DDP quota
    dict(items=8, drop_last=True, failing={1}),  # nothing left to replace it: the batch left short is dropped
    dict(items=10, failing={9}),  # nothing left to replace it: the short last batch is delivered shorter
], ids=["ranks", "drop_last", "last_batch"])
def test_the_epoch_and_its_state_are_the_ones_a_real_loader_gives(case):
    """One failure (so its batch's answer is the only one that matters, whatever the threads'
    order): the batches delivered and the state after the last of them, here and through a real
    loader, over ranks, with ``drop_last``, and at the epoch's last batch."""
    failing, ranks = case.pop("failing"), {key: case[key] for key in ("rank", "world_size") if key in case}
    logic = Run(window=2, **case)
    handed = [batch for batch in logic.epoch(failing=failing) if batch != "drop"]
    with AsyncLoader(list(range(case["items"])), batch_size=4, read=False, decode=FailsOn(failing), on_error="skip",
                     max_failures=5, shuffle=False, prefetch=2, processes=0, drop_last=case.get("drop_last", False),
                     **ranks) as loader:
        got = []
        for batch in loader:
            got.append(batch[:, 0].tolist())
            state = loader.state_dict()
    assert got == handed
    assert {key: state[key] for key in ("delivered", "batches", "skipped", "padded")} == logic.ledger.as_state()


def test_out_of_order_a_real_loader_hands_out_first_the_batch_that_finished_first():
    """As ``test_out_of_order_a_finished_batch_passes_a_slow_one``, through a real loader: batch
    0's second sample waits (an event, not a timer) until the user has had a batch."""
    handed = threading.Event()

    def decode(index):
        if index == 1:
            handed.wait(30)
        return np.full(2, index, np.int64)

    logic = Run(window=2, in_order=False)
    logic.assign()
    logic.answer(1)
    with AsyncLoader(list(range(12)), batch_size=4, read=False, decode=decode, shuffle=False, prefetch=2,
                     processes=0, num_threads=2, in_order=False) as loader:
        got = []
        for batch in loader:
            got.append(batch[:, 0].tolist())
            handed.set()
    assert got[0] == logic.hand_out() == [4, 5, 6, 7]
    assert sorted(got[1:]) == [[0, 1, 2, 3], [8, 9, 10, 11]]


class WatchedLock:
    """The driver's lock, watched: ``arrived`` once the thread ``watched`` comes to it, ``left``
    once that thread has let it go; ``owner``: the thread holding it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.owner: int | None = None
        self.watched: int | None = None
        self.arrived, self.left = threading.Event(), threading.Event()

    def __enter__(self) -> None:
        me = threading.get_ident()
        if me == self.watched:
            self.arrived.set()
        self._lock.acquire()
        self.owner = me

    def __exit__(self, *exc: Any) -> None:
        me, self.owner = self.owner, None
        self._lock.release()
        if me == self.watched:
            self.left.set()


def test_out_of_order_a_close_on_another_thread_while_the_user_looks_for_a_batch_gives_the_closed_error():
    """in_order=False: the user's thread looks through the window's batches for a complete one
    while close() on another thread clears them. It used to fail with "dictionary changed size
    during iteration"; it gets the batch it found or the closed error. Driven by events: the look
    at the first batch waits until the stop has cleared the window, or is held at the driver's
    lock by this thread."""
    with AsyncLoader(list(range(64)), batch_size=4, read=False, decode=lambda index: np.int64(index), shuffle=False,
                     prefetch=4, processes=0, num_threads=2, in_order=False) as loader:
        iterator = iter(loader)
        next(iterator)  # the pass runs; the window holds the next batches
        driver = loader._passes.driver
        lock = driver._lock = WatchedLock()
        real_ready, stoppers = driver.window.ready, []

        def stop() -> None:
            lock.watched = threading.get_ident()
            driver.stop()

        def ready(number: int) -> bool:  # the first look starts the stop and lets it clear the window
            if stoppers:
                return real_ready(number)
            stoppers.append(threading.Thread(target=stop))
            stoppers[0].start()
            assert lock.arrived.wait(60)
            if lock.owner != threading.get_ident():  # not held here: the stop clears the window now
                assert lock.left.wait(60)
            return False

        driver.window.ready = ready  # type: ignore[method-assign]
        try:
            next(iterator)  # the batch it found before the stop, or the closed error
        except RuntimeError as error:
            assert str(error) == ENDED  # the pass has ended with it: nothing more to ask
            stoppers[0].join()
            return
        stoppers[0].join()
        with pytest.raises(RuntimeError, match="this iteration has ended"):
            next(iterator)


# ----- which pipeline fills which rows -----


class Recorded:
    """``count`` pipelines that only record what is sent to them."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.sent: list[tuple[int, Any]] = []

    def send(self, index: int, message: Any) -> None:
        self.sent.append((index, message))


def in_flight(number: int, positions: list[int], segment: int) -> InFlight:
    return InFlight(number, positions, SimpleNamespace(slot=segment))  # type: ignore[arg-type]


def test_a_batchs_rows_go_to_the_least_busy_pipeline_in_one_fill():
    pipes = Recorded(2)
    dispatch = Dispatch(pipes, run=7, order=np.arange(100, 120))
    first, second = in_flight(0, [0, 1, 2, 3], segment=5), in_flight(1, [4, 5, 6, 7], segment=6)
    dispatch.send(first, [0, 1, 2, 3])
    dispatch.send(second, [0, 1, 2, 3])
    assert [(index, fill.fill, fill.segment, fill.rows, fill.indices.tolist()) for index, fill in pipes.sent] == [
        (0, 0, 5, [0, 1, 2, 3], [100, 101, 102, 103]), (1, 1, 6, [0, 1, 2, 3], [104, 105, 106, 107])]
    assert (dispatch.load, first.pending, second.pending) == ([1, 1], 1, 1)
    assert dispatch.answered(1) is second and dispatch.load == [1, 0] and second.complete()
    dispatch.send(first, [2])  # a refill: to the pipeline with nothing in hand
    assert pipes.sent[-1][0] == 1 and pipes.sent[-1][1].rows == [2] and first.pending == 2


def test_with_owned_chunks_a_row_goes_to_the_pipeline_that_reads_its_chunk():
    pipes = Recorded(2)
    dispatch = Dispatch(pipes, run=0, order=np.arange(8))
    dispatch.owner = np.array([1, 1, 0, 0, -1, -1, 1, 0])  # source index -> its chunk's reader (-1: none)
    dispatch.send(in_flight(0, [5], segment=0), [0])  # no owner: the least busy, pipeline 0
    batch = in_flight(1, [0, 2, 4, 6], segment=1)
    dispatch.send(batch, [0, 1, 2, 3])
    assert sorted((index, fill.rows) for index, fill in pipes.sent[1:]) == [(0, [1]), (1, [0, 2, 3])]
    assert batch.pending == 2 and dispatch.load == [2, 1]
    assert dispatch.pipeline_for(4) == 0 and dispatch.pipeline_for(6) == 1, "the probe's: an owner, else the first"
