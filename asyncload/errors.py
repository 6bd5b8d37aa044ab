"""The errors a user catches: a sample that could not be loaded, storage that could not be listed."""

from __future__ import annotations

import re
from typing import Any

from .redact import bounded, redact, shown

CAUSE_CHARS = 200  # the longest cause a message shows; the client's whole text stays on ``__cause__``


class SampleError(Exception):
    """A sample could not be read or decoded.

    Raised in the user's thread, at the batch the sample belongs to, with the original exception
    chained as ``__cause__`` so the storage or codec error stays visible in the traceback. The
    message is a line: the item (a bounded repr), the stage, the cause (``describe``), secrets
    redacted; ``item`` and ``__cause__`` keep everything, as they were.
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
        super().__init__(f"sample {shown(item)} failed at {stage}: {describe(cause)}")
        self.__cause__ = cause

    def __reduce__(self):
        # The message goes as it is: a cause that pickles without its attributes (the reader's
        # ``read_detail``, see ``describe``) would otherwise lose part of it in another process.
        state = {"epoch": self.epoch, "rank": self.rank, "args": self.args}
        return (type(self), (self.item, self.stage, self.cause), state)


def describe(error: BaseException) -> str:
    """``Type: cause`` of ``error`` in one line (``cause_line``), with what the reader noted on
    it after its last attempt (``read_detail``: "attempt 3 of 3", and for a ranged read which
    bytes of which URL), so a read that failed after its retries says so wherever its error is
    shown; redacted (see ``redact``)."""
    detail = getattr(error, "read_detail", None)
    line = cause_line(redact(str(error)))  # redacted before it is cut: a cut could part a secret from its name
    detail = f" ({bounded(detail, CAUSE_CHARS)})" if detail else ""
    return f"{type(error).__name__}{': ' + line if line else ''}{detail}"


_DEBUG_DUMP = "\n\nDebug source:"  # obstore appends the Rust client's error, pretty-printed, after it
_XML_ERROR = re.compile(r"<\?xml.*|<Error>.*", re.S)
_ELAPSED = re.compile(r" in [\d.]+(?:ns|µs|us|ms|s)\b")


def cause_line(text: str) -> str:
    """A client's error text in one line of at most ``CAUSE_CHARS`` (its middle cut where longer:
    the start says what failed, the end why): its first non-empty line; for obstore's, without
    the request's timing, an S3 error document as its code and message, and the reason the Rust
    dump ends with ("Connection refused") where the line has none."""
    text, _, dump = text.partition(_DEBUG_DUMP)
    xml = _XML_ERROR.search(text)
    if xml is not None:
        found = (re.search(f"<{tag}>(.*?)</{tag}>", xml.group()) for tag in ("Code", "Message"))
        text = text[: xml.start()] + ": ".join(match.group(1) for match in found if match is not None)
    line = next((line.strip() for line in text.splitlines() if line.strip()), "")
    line = _ELAPSED.sub("", line)
    reasons = re.findall(r'message: "([^"]+)"', dump)
    line += f" ({reasons[-1]})" if reasons and reasons[-1] not in line else ""
    if len(line) > CAUSE_CHARS:  # the middle goes, at spaces: a client's chain of causes ends with the deepest
        head = line[: CAUSE_CHARS // 3].rsplit(" ", 1)[0]
        tail = line[len(line) - (CAUSE_CHARS - len(head) - 5):]
        line = f"{head} ... {tail.split(' ', 1)[-1]}"
    return line


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
        listed = "; ".join(f"{shown(f.item)} ({f.stage}: {describe(f.cause)})" for f in self.failures[:5])
        more = f"; and {len(self.failures) - 5} more" if len(self.failures) > 5 else ""
        self.item = [f.item for f in self.failures]
        self.stage = "epoch"
        self.cause = self.failures[-1]
        self.epoch, self.rank = self.cause.epoch, self.cause.rank
        Exception.__init__(self, f"{len(self.failures)} samples failed, more than max_failures={max_failures}"
                                 f"{where(self.epoch, self.rank)}: {listed}{more}")
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
        super().__init__(f"{action} {bounded(str(url))} failed after {attempts} attempt{'s' if attempts != 1 else ''}: "
                         f"{describe(cause)}")
        self.__cause__ = cause

    def __reduce__(self):
        return (type(self), (self.url, self.action, self.attempts, self.cause))
