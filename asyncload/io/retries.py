"""Retrying a read: which errors another try may fix, how long to wait between tries, when to
give up, and what the error that ends a read says about its tries.

A read gives up by time, not only by count (``RetryBudget``): a refused connection fails in
microseconds, so six tries counted from a dead server span a few seconds of backoff, and a
storage restart of five seconds failed the epoch. By default a transient error is retried until
``read_retry_seconds`` (60 s) have passed since the read first failed, and at least
``MIN_TIMED_RETRIES`` times (a read that fails by timing out spends ``read_timeout`` a try);
``read_retries=N`` asks for exactly N retries instead, whatever the time.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import tenacity

from .blocking import StuckCalls

# Errors that another try cannot fix, though some are OSErrors. Checked first.
PERMANENT_ERRORS = (
    FileNotFoundError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    ValueError,
    TypeError,
    NotImplementedError,
)
# obstore raises FileNotFoundError itself, and these of its own (all derive from Exception only).
OBSTORE_PERMANENT_ERRORS = {
    "NotFoundError": FileNotFoundError,
    "PermissionDeniedError": PermissionError,
    "UnauthenticatedError": PermissionError,
    "InvalidPathError": ValueError,
    "UnknownConfigurationKeyError": ValueError,
    "NotSupportedError": NotImplementedError,
}
# Errors another try may fix: the system's and the network's (OSError holds ConnectionError and
# TimeoutError, so resets, refusals and the read timeout), a pool whose calls are stuck on storage,
# and the storage clients' own (obstore's GenericError, botocore's EndpointConnectionError, aiohttp's
# ServerDisconnectedError: from a module of these packages). Anything else (a KeyError in a user's
# ``read``) is a bug or bad input that fails at once: retried, it would fail for a minute, and be
# reported as "storage failed for 60.0 s".
TRANSIENT_ERRORS = (OSError, asyncio.TimeoutError, StuckCalls)
CLIENT_PACKAGES = frozenset({"obstore", "botocore", "aiobotocore", "aiohttp", "urllib3", "requests", "http",
                             "google", "azure", "fsspec", "s3fs", "gcsfs", "adlfs", "ocifs", "huggingface_hub"})
# The clients' errors of configuration, which no try fixes.
CLIENT_PERMANENT_NAMES = frozenset({"NoCredentialsError", "PartialCredentialsError", "ParamValidationError",
                                    "NoRegionError", "UnknownServiceError"})
RANGE_PAST_END = re.compile(r"status code: 416|Range Not Satisfiable", re.IGNORECASE)
MAX_STEP_S = 2.0  # the backoff's cap: a server back from a restart is seen within 2 s
MIN_TIMED_RETRIES = 2  # retries a read gets under a time budget even once the budget is spent


# The backoff: tenacity's exponential wait for the sure half of each step, its random exponential
# wait (uniform up to the step) for the other half: "equal jitter", see ``backoff``.
HALF_STEP = dict(multiplier=0.05, max=MAX_STEP_S / 2)
EQUAL_JITTER = tenacity.wait_exponential(**HALF_STEP) + tenacity.wait_random_exponential(**HALF_STEP)


def backoff(attempt: int) -> float:
    """Seconds to wait before retry ``attempt`` (0-based): half of an exponential step (0.1 s,
    doubling, at most ``MAX_STEP_S``) for sure, the other half drawn at random ("equal jitter").
    The random half spreads many readers' retries apart; the sure half keeps a burst of fast
    failures from spending the retries at once; the cap keeps the wait for a server that is back
    short, so an outage costs its own length plus at most a couple of seconds."""
    state = tenacity.RetryCallState(None, None, (), {})
    state.attempt_number = attempt + 1
    return EQUAL_JITTER(state)


@dataclass(frozen=True)
class RetryBudget:
    """When a request stops retrying transient errors: ``retries`` None retries for ``seconds``
    after its first failure (and at least ``MIN_TIMED_RETRIES`` times); an int retries exactly
    that many times. The reads' budget is by time, the listings' (before a loader runs) by count.

    ``retrying`` is the one retry loop, tenacity's, under this budget: synchronous for a listing,
    awaited for a read. Its two rules of giving up are written here, not as tenacity's
    ``stop_after_delay``: under a time budget at least ``MIN_TIMED_RETRIES`` retries are made even
    past the budget (a read that fails by timing out spends ``read_timeout`` a try), and the last
    wait ends at the budget rather than a backoff step past it; and both read a clock that tests
    replace (tenacity's own stops read ``time.monotonic``)."""

    retries: int | None = None
    seconds: float = 60.0

    def gives_up(self, attempt: int, failing_for: float) -> bool:
        """Whether try ``attempt`` (1-based), having failed ``failing_for`` seconds after the
        first began, is the last."""
        if self.retries is not None:
            return attempt > self.retries
        return attempt > MIN_TIMED_RETRIES and failing_for >= self.seconds

    def pause(self, attempt: int, failing_for: float) -> float:
        """Seconds to wait after try ``attempt`` failed, when another follows: the backoff, its
        end clipped to the time budget once the tries the budget owes are made."""
        pause = backoff(attempt - 1)
        if self.retries is not None or attempt <= MIN_TIMED_RETRIES:
            return pause
        return max(0.0, min(pause, self.seconds - failing_for))  # tenacity < 8.3 asks after its stop, a moment later

    def wait(self, attempt: int, failing_for: float) -> float | None:
        """Seconds to wait before the next try after try ``attempt`` (1-based) failed, the read
        having failed for ``failing_for`` seconds; None to give up. Under a time budget the last
        wait ends at the budget, so a read gives up within the budget plus one try."""
        return None if self.gives_up(attempt, failing_for) else self.pause(attempt, failing_for)

    def retrying(self, *, asynchronous: bool, on_retry: Callable[[float], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], Any] | None = None,
                 started: float | None = None) -> tenacity.BaseRetrying:
        """tenacity's loop under this budget: retries what ``is_transient`` says another try may
        fix, re-raises the last error as it is (``failing_for`` then on the returned loop's
        ``statistics``), calls ``on_retry(wait)`` before each wait. ``started``: when the first
        try began (by ``clock``), if before the loop's (see ``retried``)."""
        began = clock() if started is None else started

        def failing_for(state: tenacity.RetryCallState) -> float:
            state.retry_object.statistics["failing_for"] = seconds = clock() - began
            return seconds

        kinds = dict(
            retry=tenacity.retry_if_exception(is_transient),
            stop=lambda state: self.gives_up(state.attempt_number, failing_for(state)),
            wait=lambda state: self.pause(state.attempt_number, failing_for(state)),
            before_sleep=None if on_retry is None else (lambda state: on_retry(state.next_action.sleep)),
            reraise=True,
        )
        if asynchronous:
            return tenacity.AsyncRetrying(sleep=sleep or asyncio.sleep, **kinds)
        return tenacity.Retrying(sleep=sleep or time.sleep, **kinds)


async def retried(fetch: Callable[[], Awaitable[Any]], budget: RetryBudget, what: str | None,
                  on_retry: Callable[[float], None], clock: Callable[[], float] = time.monotonic,
                  sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> Any:
    """``fetch()``, tried again after transient errors while ``budget`` allows (``on_retry(wait)``
    counts each retry); the error that ends it is noted with ``what`` was read, on which attempt
    and, under a time budget, for how long the read failed (see ``note_attempt``).

    The first try is a plain call: tenacity's loop costs tens of microseconds of Python a call
    (65 us measured on this project's busy 2-core box, against obstore's 440 us of CPU a GET) and
    a read is the hot path. Only a read that failed enters the loop, whose first attempt is that
    failure (raised again, not fetched again), so its attempts and clock are the read's."""
    started = clock()
    try:
        return await fetch()  # the caller's fetch applies the read timeout
    except Exception as error:
        first: Exception | None = error

    async def attempt() -> Any:
        nonlocal first
        try:
            if first is None:
                return await fetch()
            error, first = first, None
            raise error
        except Exception as error:
            permanent = as_builtin(error)  # obstore's error for what no try fixes, as fsspec's
            if permanent is None:
                raise
            raise permanent from error

    loop = budget.retrying(asynchronous=True, on_retry=on_retry, clock=clock, sleep=sleep, started=started)
    try:
        return await loop(attempt)
    except Exception as error:
        attempts = loop.statistics.get("attempt_number", 1)
        transient = is_transient(error)
        note_attempt(error, attempts, budget, what, transient=transient,
                     failing_for=loop.statistics.get("failing_for") if transient else None)
        raise


def note_attempt(error: BaseException, attempt: int, budget: RetryBudget | int, what: str | None, transient: bool,
                 failing_for: float | None = None) -> BaseException:
    """Notes on ``error``, as ``read_detail``, ``what`` was read (a ranged read's bytes and URL;
    a key is in its ``SampleError`` already) and its tries: after transient errors always
    ("attempt 3 of 3": the retries ran out; under a time budget "storage failed for 61.3 s,
    attempt 40 (read_retry_seconds=60)"), after permanent ones only if retries came before.
    ``read_attempts`` and ``read_failing_s`` hold the figures. ``SampleError`` and
    ``loader.stats.failures`` show it (``describe``). Attributes, not a new exception: the
    error keeps its type, and they pickle with it. ``budget`` as an int: that many attempts."""
    budget = RetryBudget(retries=budget - 1) if isinstance(budget, int) else budget
    parts = [what] if what else []
    if transient and budget.retries is None and failing_for is not None:
        parts.append(f"storage failed for {failing_for:.1f} s, attempt {attempt} "
                     f"(read_retry_seconds={budget.seconds:g})")
    elif transient or attempt > 1:
        parts.append(f"attempt {attempt}" + (f" of {budget.retries + 1}" if budget.retries is not None else ""))
    error.read_detail = ", ".join(parts) or None  # type: ignore[attr-defined]
    error.read_attempts = attempt  # type: ignore[attr-defined]
    error.read_failing_s = failing_for  # type: ignore[attr-defined]
    return error


def is_transient(error: BaseException) -> bool:
    """Whether another try may fix ``error`` (not one of ``PERMANENT_ERRORS``): one of
    ``TRANSIENT_ERRORS``, or a storage client's own error other than one of configuration."""
    if isinstance(error, PERMANENT_ERRORS):
        return False
    if isinstance(error, TRANSIENT_ERRORS):
        return True
    name = type(error).__name__
    return name not in CLIENT_PERMANENT_NAMES and name not in OBSTORE_PERMANENT_ERRORS and any(
        kind.__module__.partition(".")[0] in CLIENT_PACKAGES for kind in type(error).__mro__)


class RangeNotSatisfiable(ValueError):
    """A ranged read that starts at or past the object's end (HTTP 416): the object is shorter
    than the reader was told (a shard's index), which another try will not change."""


def as_builtin(error: Exception) -> Exception | None:
    """obstore's errors for what another try cannot fix, as the built-in errors the other fsspec
    filesystems raise (so they are not retried and read the same); None for any other error."""
    kind = type(error)
    if kind.__module__ != "obstore.exceptions":
        return None
    if RANGE_PAST_END.search(str(error)):
        return RangeNotSatisfiable(str(error).splitlines()[0][:300])
    builtin = OBSTORE_PERMANENT_ERRORS.get(kind.__name__)
    return None if builtin is None else builtin(str(error))
