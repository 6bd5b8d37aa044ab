"""The errors a user catches: a sample that could not be loaded, storage that could not be listed."""

from __future__ import annotations

from typing import Any


class SampleError(Exception):
    """A sample could not be read or decoded.

    Raised in the user's thread, at the batch the sample belongs to, with the original exception
    chained as ``__cause__`` so the storage or codec error stays visible in the traceback.
    """

    def __init__(self, item: Any, stage: str, cause: BaseException) -> None:
        self.item = item
        self.stage = stage
        self.cause = cause
        super().__init__(f"sample {item!r} failed at {stage}: {type(cause).__name__}: {cause}")
        self.__cause__ = cause

    def __reduce__(self):
        return (type(self), (self.item, self.stage, self.cause))


class TooManyFailures(SampleError):
    """With ``on_error="skip"``, more samples failed in an epoch than ``max_failures`` allows.
    ``failures`` holds every ``SampleError`` of the epoch so far."""

    def __init__(self, failures: list[SampleError], max_failures: int | float) -> None:
        self.failures = list(failures)
        self.max_failures = max_failures
        shown = "; ".join(f"{f.item!r} ({f.stage}: {type(f.cause).__name__}: {f.cause})" for f in self.failures[:5])
        more = f"; and {len(self.failures) - 5} more" if len(self.failures) > 5 else ""
        self.item = [f.item for f in self.failures]
        self.stage = "epoch"
        self.cause = self.failures[-1]
        Exception.__init__(self, f"{len(self.failures)} samples failed, more than max_failures={max_failures}: {shown}{more}")
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
