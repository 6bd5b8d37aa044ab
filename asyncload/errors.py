"""The one error type a user needs to catch: a sample that could not be loaded."""

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
