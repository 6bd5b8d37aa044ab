"""The errors a user catches: a sample that could not be loaded, storage that could not be listed."""

from __future__ import annotations

from typing import Any


class SampleError(Exception):
    """A sample could not be read or decoded.

    Raised in the user's thread, at the batch the sample belongs to, with the original exception
    chained as ``__cause__`` so the storage or codec error stays visible in the traceback.
    ``epoch`` and ``rank`` say where it failed (``loader.stats.failures`` spans epochs while the
    failure budget counts one): the driver sets them when it records the failure, None before
    (and ``rank`` in a job of one rank).
    """

    def __init__(self, item: Any, stage: str, cause: BaseException) -> None:
        self.item = item
        self.stage = stage
        self.cause = cause
        self.epoch: int | None = None
        self.rank: int | None = None
        super().__init__(f"sample {item!r} failed at {stage}: {describe(cause)}")
        self.__cause__ = cause

    def __reduce__(self):
        # The message goes as it is: a cause that pickles without its attributes (the reader's
        # ``read_detail``, see ``describe``) would otherwise lose part of it in another process.
        state = {"epoch": self.epoch, "rank": self.rank, "args": self.args}
        return (type(self), (self.item, self.stage, self.cause), state)


def describe(error: BaseException) -> str:
    """``Type: message`` of ``error``, with what the reader noted on it after its last attempt
    (``read_detail``: "attempt 3 of 3", and for a ranged read which bytes of which URL), so a read
    that failed after its retries says so wherever its error is shown."""
    detail = getattr(error, "read_detail", None)
    return f"{type(error).__name__}: {error}" + (f" ({detail})" if detail else "")


def where(epoch: int | None, rank: int | None) -> str:
    """Where failures happened, for messages that list them: ``' in epoch 3 on rank 1'``, the
    parts known."""
    return (f" in epoch {epoch}" if epoch is not None else "") + (f" on rank {rank}" if rank is not None else "")


class TooManyFailures(SampleError):
    """With ``on_error="skip"``, more samples failed in an epoch than ``max_failures`` allows.
    ``failures`` holds every ``SampleError`` of the epoch so far; ``epoch`` and ``rank`` are theirs."""

    def __init__(self, failures: list[SampleError], max_failures: int | float) -> None:
        self.failures = list(failures)
        self.max_failures = max_failures
        shown = "; ".join(f"{f.item!r} ({f.stage}: {describe(f.cause)})" for f in self.failures[:5])
        more = f"; and {len(self.failures) - 5} more" if len(self.failures) > 5 else ""
        self.item = [f.item for f in self.failures]
        self.stage = "epoch"
        self.cause = self.failures[-1]
        self.epoch, self.rank = self.cause.epoch, self.cause.rank
        Exception.__init__(self, f"{len(self.failures)} samples failed, more than max_failures={max_failures}"
                                 f"{where(self.epoch, self.rank)}: {shown}{more}")
        self.__cause__ = self.cause

    def __reduce__(self):
        return (type(self), (self.failures, self.max_failures))


class StorageError(OSError):
    """A request to storage that is not a sample's read (listing a folder or bucket prefix,
    reading an index) failed after its retries. The message names the URL, what was asked and
    how many attempts were made, in a line; the client's own exception is ``__cause__``."""

    def __init__(self, url: str, action: str, attempts: int, cause: BaseException) -> None:
        self.url = url
        self.action = action
        self.attempts = attempts
        self.cause = cause
        detail = str(cause).splitlines()[0] if str(cause) else ""
        if len(detail) > 160:
            detail = detail[:157] + "..."
        super().__init__(f"{action} {url} failed after {attempts} attempt{'s' if attempts != 1 else ''}: "
                         f"{type(cause).__name__}{': ' + detail if detail else ''}")
        self.__cause__ = cause

    def __reduce__(self):
        return (type(self), (self.url, self.action, self.attempts, self.cause))
