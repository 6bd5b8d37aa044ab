"""The one pool that gives up on stuck threads (``io/blocking.AbandoningPool``), driven by hand: the
test plays the watcher (the decode's watchdog, a read's waiting caller) and abandons a call
itself, so nothing here waits on a clock; calls that hang wait on an event the test sets. Its
two users: ``BlockingCalls`` (the reads) and ``pipeline/workers.DecodeWorkers`` (the decodes)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Callable

import pytest

from asyncload.io.blocking import AbandoningPool, BlockingCalls, CallSlot, StuckCalls, current_slot
from asyncload.pipeline.threads import wait_ended
from asyncload.pipeline.workers import DecodeWorkers
from tests.conftest import wait_until


class Hanging:
    """Jobs that mark their start in their thread's slot and hang until ``let_go`` is set."""

    def __init__(self) -> None:
        self.let_go = threading.Event()
        self.started: list = []  # (slot, started) of each job that began
        self.results: list[str] = []

    def job(self, name: str):
        def run() -> None:
            slot = current_slot()
            slot.started = time.perf_counter()
            self.started.append((slot, slot.started))
            self.let_go.wait()
            if slot.claim():
                self.results.append(name)
        return run


def stop(pool: AbandoningPool) -> None:
    pool.stop()
    assert not wait_ended(pool.all_threads(), time.monotonic() + 10)


@pytest.mark.parametrize("make", [lambda: AbandoningPool(1, "asyncload-test"),
                                  lambda: DecodeWorkers(1, None, name="asyncload-test")], ids=["reads", "decodes"])
def test_an_abandoned_call_loses_its_thread_to_a_new_one_and_writes_nothing_when_it_returns(make):
    pool, hanging = make(), Hanging()
    pool.ensure_serving()
    pool.submit(hanging.job("stuck"))
    assert wait_until(lambda: len(hanging.started) == 1, timeout=10)
    slot, started = hanging.started[0]
    assert slot.abandon(started) and not slot.abandon(started), "abandoned once"
    assert pool.replace(slot) and pool.lost() == [slot]
    done = threading.Event()
    pool.submit(done.set)  # served by the thread that took the stuck one's place
    assert done.wait(10)
    hanging.let_go.set()
    assert wait_until(lambda: not pool.lost(), timeout=10), "the lost thread ends when its call returns"
    assert not slot.thread.is_alive() or wait_ended([slot.thread], time.monotonic() + 10) == []
    assert hanging.results == [], "its result was not written"
    assert pool.serving() == 1
    stop(pool)


def test_past_max_lost_no_thread_is_started_and_the_pool_serves_again_once_they_return():
    pool, hanging = AbandoningPool(1, "asyncload-test"), Hanging()
    pool.max_lost = 1
    pool.ensure_serving()
    for name in ("a", "b"):
        pool.submit(hanging.job(name))
        assert wait_until(lambda: len(hanging.started) == ("a", "b").index(name) + 1, timeout=10)
        slot, started = hanging.started[-1]
        assert slot.abandon(started)
        replaced = pool.replace(slot)
    assert replaced is False and pool.serving() == 0 and len(pool.lost()) == 2
    hanging.let_go.set()
    assert wait_until(lambda: not pool.lost() and pool.serving() == 1, timeout=10), "a thread took their place"
    done = threading.Event()
    pool.submit(done.set)
    assert done.wait(10)
    stop(pool)


def test_a_blocking_call_past_its_timeout_is_abandoned_and_its_late_result_never_set():
    """A read's caller gave up on its call (``read_timeout``): the call returning later sets
    nothing (the slot's claim), its thread ends, and calls go on on the thread that replaced it;
    after a shutdown a call fails at once."""
    calls, let_go = BlockingCalls(1, "asyncload-test", "read_timeout"), threading.Event()
    submitted = []

    def stuck() -> str:
        let_go.wait()
        return "late"

    async def main() -> list:
        outcomes = []
        # the stuck call's timeout is the one clock here: it fails only by hanging; the next call
        # gets a long one, so a loaded machine that starts it late does not fail it
        for function, timeout in ((stuck, 0.2), (lambda: "next", 60)):
            try:
                outcomes.append(await calls.call_async(function, timeout=timeout))
            except TimeoutError as error:
                outcomes.append(str(error))
        return outcomes

    original_submit = calls.submit
    calls.submit = lambda *args, **kwargs: submitted.append(original_submit(*args, **kwargs)) or submitted[-1]
    assert asyncio.run(main()) == ["timed out after read_timeout=0.2 s", "next"]
    assert len(calls.pool.lost()) == 1
    let_go.set()
    assert wait_until(lambda: not calls.pool.lost(), timeout=10)
    assert not submitted[0].future.done(), "the late result was not set"
    calls.shutdown(10)
    with pytest.raises(RuntimeError, match="shut down"):
        calls.call(lambda: None, timeout=1)


def test_a_stop_cancels_the_calls_still_queued():
    calls, let_go = BlockingCalls(1, "asyncload-test"), threading.Event()
    running = calls.submit(let_go.wait)
    queued = calls.submit(lambda: "never")
    assert wait_until(lambda: running.started is not None, timeout=10)
    let_go.set()
    assert calls.shutdown(10)
    assert running.future.result() is True and (queued.future.cancelled() or queued.future.result() == "never")


def test_too_many_stuck_calls_refuse_new_ones():
    calls, let_go = BlockingCalls(1, "asyncload-test", "read_timeout"), threading.Event()
    calls.max_lost = 1
    call = calls.submit(let_go.wait)
    assert wait_until(lambda: call.started is not None, timeout=10)
    assert call.slot.abandon(call.started)
    calls.pool.replace(call.slot)
    with pytest.raises(StuckCalls, match="1 calls are stuck past read_timeout"):
        calls.submit(lambda: None)
    let_go.set()
    assert wait_until(lambda: not calls.pool.lost(), timeout=10)
    assert calls.call(lambda: "back", timeout=10) == "back"
    calls.shutdown(10)



class ReturnsAsAbandoned(CallSlot):
    """A slot whose call returns, and whose thread ends, just after the watcher's ``abandon``
    won and before the watcher counts the thread lost (``returns()``, set by the test)."""

    __slots__ = ()
    returns: Callable[[], None] = staticmethod(lambda: None)

    def abandon(self, started: float | None = None) -> bool:
        won = super().abandon(started)
        if won:
            ReturnsAsAbandoned.returns()
        return won


@pytest.mark.parametrize("watcher", ["replace", "abandon_all"])
def test_a_call_that_returns_between_its_abandon_and_its_replace_leaves_no_lost_thread_behind(watcher, monkeypatch):
    """The watcher abandons under the slot's lock, then counts the thread lost under the pool's:
    the call may return in between and its thread end first (a call that ends at its timeout).
    It must not stay counted lost for ever (a ghost that the cap, ``StuckCalls`` and ``serving``
    count), nor be replaced twice (once as its thread ends, once by the watcher)."""
    pool, hanging = AbandoningPool(1, "asyncload-test", slot=ReturnsAsAbandoned), Hanging()
    pool.ensure_serving()
    pool.submit(hanging.job("stuck"))
    assert wait_until(lambda: len(hanging.started) == 1, timeout=10)
    slot, started = hanging.started[0]

    def returns() -> None:
        hanging.let_go.set()
        assert wait_ended([slot.thread], time.monotonic() + 10) == []

    monkeypatch.setattr(ReturnsAsAbandoned, "returns", staticmethod(returns))
    if watcher == "replace":  # a read's caller, or the decode's watchdog
        assert slot.abandon(started) and pool.replace(slot)
    else:  # a stop
        pool.abandon_all()
    assert hanging.results == []
    assert pool.lost() == [], "no ghost: its thread has ended"
    assert pool.serving() == 1 and len(pool.slots) == 1, "one thread took its place, not two"
    done = threading.Event()
    pool.submit(done.set)
    assert done.wait(10) or watcher == "abandon_all"
    stop(pool)


def test_a_shutdown_waits_for_a_thread_started_as_it_began():
    """A thread started as the shutdown begins (a call submitted then; or a lost call returning,
    whose thread takes its own place) is one the shutdown waits for: it reports a thread still
    running, not that all have ended."""
    calls, hold, let_go = BlockingCalls(2, "asyncload-test"), threading.Event(), threading.Event()
    first = calls.submit(hold.wait)  # on the first thread, which ends soon after the shutdown began
    assert wait_until(lambda: first.started is not None, timeout=10)
    real_stop, late = calls.pool.stop, []

    def stop_as_a_call_comes() -> bool:
        late.append(calls.submit(let_go.wait))  # on a second thread, started now
        assert wait_until(lambda: late[0].started is not None, timeout=10)
        hold.set()
        return real_stop()

    calls.pool.stop = stop_as_a_call_comes
    try:
        assert calls.shutdown(0.2) is False, "a thread still runs its call"
    finally:
        let_go.set()
    assert late[0].future.result(10) is True
    assert wait_ended([slot.thread for slot in calls.pool.slots], time.monotonic() + 10) == []
