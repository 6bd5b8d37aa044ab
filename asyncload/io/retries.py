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
import random
import re
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

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


def backoff(attempt: int) -> float:
    """Seconds to wait before retry ``attempt`` (0-based): half of an exponential step (0.1 s,
    doubling, at most ``MAX_STEP_S``) for sure, the other half drawn at random ("equal jitter").
    The random half spreads many readers' retries apart; the sure half keeps a burst of fast
    failures from spending the retries at once; the cap keeps the wait for a server that is back
    short, so an outage costs its own length plus at most a couple of seconds."""
    step = min(MAX_STEP_S, 0.1 * 2**attempt)
    return step / 2 + random.uniform(0, step / 2)


@dataclass(frozen=True)
class RetryBudget:
    """When a read stops retrying transient errors: ``retries`` None retries for ``seconds``
    after its first failure (and at least ``MIN_TIMED_RETRIES`` times); an int retries exactly
    that many times."""

    retries: int | None = None
    seconds: float = 60.0

    def wait(self, attempt: int, failing_for: float) -> float | None:
        """Seconds to wait before the next try after try ``attempt`` (1-based) failed, the read
        having failed for ``failing_for`` seconds; None to give up. Under a time budget the last
        wait ends at the budget, so a read gives up within the budget plus one try."""
        if self.retries is not None:
            return backoff(attempt - 1) if attempt <= self.retries else None
        left = self.seconds - failing_for
        if attempt > MIN_TIMED_RETRIES and left <= 0:
            return None
        pause = backoff(attempt - 1)
        return pause if attempt <= MIN_TIMED_RETRIES else min(pause, left)


async def retried(fetch: Callable[[], Awaitable[Any]], budget: RetryBudget, what: str | None,
                  on_retry: Callable[[float], None]) -> Any:
    """``fetch()``, tried again after transient errors while ``budget`` allows (``on_retry(wait)``
    counts each retry); the error that ends it is noted with ``what`` was read, on which attempt
    and, under a time budget, for how long the read failed (see ``note_attempt``)."""
    started = time.monotonic()
    attempt = 1
    while True:
        try:
            return await fetch()  # the caller's fetch applies the read timeout
        except PERMANENT_ERRORS as error:
            note_attempt(error, attempt, budget, what, transient=False)
            raise
        except Exception as error:
            permanent = as_builtin(error)
            if permanent is not None:
                raise note_attempt(permanent, attempt, budget, what, transient=False) from error
            if not is_transient(error):
                note_attempt(error, attempt, budget, what, transient=False)
                raise
            failing_for = time.monotonic() - started
            pause = budget.wait(attempt, failing_for)
            if pause is None:
                note_attempt(error, attempt, budget, what, transient=True, failing_for=failing_for)
                raise
            on_retry(pause)
            await asyncio.sleep(pause)
            attempt += 1


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
