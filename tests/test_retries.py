"""The one retry loop (``io/retries.py``: tenacity's, under a ``RetryBudget``) as its two users run
it: a read (awaited, by time by default, the error noted with its tries) and a request a source
makes up front (``listing.with_retries``: synchronous, by count, a ``StorageError``). Time is a fake
clock that only the loop's own waits move: nothing here sleeps, so nothing depends on the load."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from asyncload import StorageError
from asyncload.io import retries
from asyncload.io.retries import MIN_TIMED_RETRIES, RetryBudget, retried
from asyncload.sources import listing


class FakeTime:
    """A clock moved by the loop's waits and by each try's own duration (``per_try``)."""

    def __init__(self, per_try: float = 0.0) -> None:
        self.now, self.per_try, self.waits = 1000.0, per_try, []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.now += seconds

    def sleep_sync(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.now += seconds


class Failing:
    """A request that fails with ``error`` its first ``failures`` calls (every call: None), each
    call taking ``time.per_try`` of the fake clock, then returns "ok"."""

    def __init__(self, time: FakeTime, error: Exception, failures: int | None = None) -> None:
        self.time, self.error, self.failures, self.calls = time, error, failures, 0

    def __call__(self) -> str:
        self.calls += 1
        self.time.now += self.time.per_try
        if self.failures is None or self.calls <= self.failures:
            raise self.error
        return "ok"

    async def fetch(self) -> str:
        return self()


def read(budget: RetryBudget, request: Failing, time: FakeTime, retried_waits: list[float] | None = None) -> str:
    counted = [] if retried_waits is None else retried_waits
    return asyncio.run(retried(request.fetch, budget, "bytes 0-9 of s3://b/k", counted.append, clock=time.clock,
                               sleep=time.sleep))


def test_a_read_by_count_is_tried_exactly_once_more_than_its_retries_then_says_so():
    time = FakeTime()
    request, counted = Failing(time, ConnectionResetError("reset")), []
    with pytest.raises(ConnectionResetError) as caught:
        read(RetryBudget(retries=3), request, time, counted)
    assert request.calls == 4 and counted == time.waits and len(counted) == 3
    assert caught.value.read_detail == "bytes 0-9 of s3://b/k, attempt 4 of 4" and caught.value.read_attempts == 4
    assert all(min(2.0, 0.1 * 2**a) / 2 <= w <= min(2.0, 0.1 * 2**a) for a, w in enumerate(counted)), "equal jitter"


def test_a_read_by_time_gives_up_at_the_budget_not_a_step_past_it_and_says_for_how_long():
    random.seed(3)
    time = FakeTime()
    request = Failing(time, ConnectionRefusedError("refused"))
    with pytest.raises(ConnectionRefusedError) as caught:
        read(RetryBudget(seconds=60.0), request, time)
    assert time.now - 1000.0 == pytest.approx(60.0) and request.calls > 30 and max(time.waits) <= 2.0
    assert caught.value.read_detail == (f"bytes 0-9 of s3://b/k, storage failed for 60.0 s, attempt {request.calls} "
                                        f"(read_retry_seconds=60)")


def test_a_read_by_time_whose_tries_outlast_the_budget_still_gets_its_retries():
    """Each try times out after 25 s, past a 10 s budget: still ``MIN_TIMED_RETRIES`` retries."""
    time = FakeTime(per_try=25.0)
    request = Failing(time, TimeoutError("timed out after read_timeout=25 s"))
    with pytest.raises(TimeoutError):
        read(RetryBudget(seconds=10.0), request, time)
    assert request.calls == 1 + MIN_TIMED_RETRIES


def test_a_read_that_recovers_within_its_budget_returns_and_counts_its_waits():
    time = FakeTime()
    request, counted = Failing(time, ConnectionRefusedError("refused"), failures=5), []
    assert read(RetryBudget(), request, time, counted) == "ok"
    assert request.calls == 6 and counted == time.waits and len(counted) == 5


def test_a_permanent_error_is_not_tried_again():
    time = FakeTime()
    request = Failing(time, PermissionError("denied"))
    with pytest.raises(PermissionError) as caught:
        read(RetryBudget(retries=5), request, time)
    assert request.calls == 1 and time.waits == [] and caught.value.read_detail == "bytes 0-9 of s3://b/k"


def test_a_read_that_succeeds_at_once_never_builds_the_retry_loop(monkeypatch):
    """The hot path: a read that does not fail costs its call only (tenacity's loop, tens of
    microseconds of Python, is built for a read that failed)."""
    monkeypatch.setattr(RetryBudget, "retrying", lambda *args, **kwargs: pytest.fail("built the loop"))
    time = FakeTime()
    assert read(RetryBudget(), Failing(time, OSError("unused"), failures=0), time) == "ok"


@pytest.fixture
def fake_sleep(monkeypatch):
    time_ = FakeTime()
    monkeypatch.setattr(time, "sleep", time_.sleep_sync)  # the loop's default sleep, read when it is built
    return time_


def test_a_listing_by_count_retries_exactly_its_retries_then_names_the_url_and_attempts(fake_sleep):
    request = Failing(fake_sleep, ConnectionResetError("reset"))
    with pytest.raises(StorageError) as caught:
        listing.with_retries("s3://b/train", "listing", 2, "missing", request)
    assert request.calls == 3 and len(fake_sleep.waits) == 2
    assert str(caught.value).startswith("listing s3://b/train failed after 3 attempts: ")
    assert isinstance(caught.value.__cause__, ConnectionResetError)
    request = Failing(fake_sleep, ConnectionResetError("reset"), failures=2)
    assert listing.with_retries("s3://b/train", "listing", 2, "missing", request) == "ok" and request.calls == 3


def test_a_listing_of_what_is_not_there_or_is_denied_is_not_tried_again(fake_sleep):
    request = Failing(fake_sleep, FileNotFoundError("s3://b/train"))
    with pytest.raises(FileNotFoundError, match="^s3://b/train: no such prefix$"):
        listing.with_retries("s3://b/train", "listing", 5, "s3://b/train: no such prefix", request)
    request2 = Failing(fake_sleep, PermissionError("denied"))
    with pytest.raises(StorageError, match="failed after 1 attempt: "):
        listing.with_retries("s3://b/train", "listing", 5, "missing", request2)
    assert request.calls == request2.calls == 1 and fake_sleep.waits == []


def test_the_backoff_is_the_budgets_wait():
    random.seed(4)
    first = [RetryBudget(retries=10).wait(attempt, 0.0) for attempt in range(1, 11)]
    random.seed(4)
    assert first == [retries.backoff(attempt) for attempt in range(10)]


def test_a_pause_asked_past_the_budget_is_never_negative():
    """tenacity before 8.3 (``tenacity>=8`` is allowed) asks the wait after its stop, a moment
    later: a read whose stop said "once more" just under the budget must not wait (nor count in
    ``retry_wait_seconds``) a negative time."""
    assert RetryBudget(seconds=60.0).pause(MIN_TIMED_RETRIES + 1, 60.001) == 0.0
