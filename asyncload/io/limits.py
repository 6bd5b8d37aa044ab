"""The size budget of one sample (``AsyncLoader(max_sample_bytes=...)``): an object larger than it
fails alone, before or while it is read, never read past the budget.

Why a budget: one read is held whole in memory, so a 3 GiB object (or ``/dev/zero`` named as an
item, or a sparse file) would take 3 GiB, or all memory, and the process with it. The default,
256 MiB, is far above any image the decoders take (their pixel limit keeps a JPEG to a few tens
of MB) and above a typical clip or tensor file, yet ``io_concurrency`` reads of it still fit in a
training node's memory; raise it for larger samples (whole-slide images, long videos).
"""

from __future__ import annotations

import os
import stat
from typing import Any

DEFAULT_MAX_SAMPLE_BYTES = 256 << 20
O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
READ_STEP = 1 << 20  # a file of unknown size (a device, a FIFO, a file that grew) is read this much at a time


READ_RESULT = "what read returned"  # ``what`` for a user read's result


class SampleTooLarge(ValueError):
    """A sample's object is larger than ``max_sample_bytes`` (a ValueError: another try will not
    make it smaller). Its ``SampleError`` fails that sample alone (skipped with
    ``on_error="skip"``)."""

    def __init__(self, what: str, size: int | None, limit: int) -> None:
        self.what = what
        self.size = size
        self.limit = limit
        told = f"{size} bytes ({_mib(size)})" if size is not None else f"more than {limit} bytes"
        # The path is ``what`` and the SampleError's item: not repeated here, where it would push
        # the limit out of the 200 characters a SampleError shows of its cause.
        subject = what if what == READ_RESULT else "the object"
        super().__init__(f"{subject} is {told}, over max_sample_bytes={limit} ({_mib(limit)}); "
                         f"pass AsyncLoader(max_sample_bytes=...) a larger budget to read it")

    def __reduce__(self):  # to a parent process as it is (the arguments are not the message)
        return (type(self), (self.what, self.size, self.limit), self.__dict__)


def _mib(size: int) -> str:
    return f"{size / (1 << 20):.1f} MiB"


def checked(data: Any, limit: int | None, what: str) -> Any:
    """``data`` if it is not bytes or holds at most ``limit`` bytes; else ``SampleTooLarge``
    (what a read that could not be bounded while reading is held to after it)."""
    if limit is not None and isinstance(data, (bytes, bytearray, memoryview)) and len(data) > limit:
        raise SampleTooLarge(what, len(data), limit)
    return data


def read_file(path: str, limit: int | None, regular_only: bool = False) -> bytes | None:
    """The bytes of the local file ``path``, refusing one over ``limit`` bytes: a regular file by
    its size before any read (open, ``fstat``, one ``pread``, close: a Python file object costs
    several times more GIL time), anything else (a device, a FIFO, a file growing under us) by
    reading at most ``limit + 1`` bytes. Blocks on a FIFO with no writer: call it where a timeout
    applies, or with ``regular_only`` (a decode thread): then opened without blocking, and None
    for anything but a regular file, which may never answer: the caller reads it where a timeout
    applies (the reader's read threads)."""
    fd = os.open(path, os.O_RDONLY | O_CLOEXEC | (os.O_NONBLOCK if regular_only else 0))
    try:
        info = os.fstat(fd)
        regular = stat.S_ISREG(info.st_mode)
        if regular_only and not regular:
            return None
        size = info.st_size if regular else 0
        if limit is not None and size > limit:
            raise SampleTooLarge(path, size, limit)
        return read_bounded(fd, size, limit, path)
    finally:
        os.close(fd)


def read_bounded(fd: int, size: int, limit: int | None, what: str) -> bytes:
    """Reads file ``fd`` from its start: a regular file of ``size`` bytes in one ``pread`` (what
    it holds then), anything that reports no size (a device, a FIFO, ``/proc``) ``READ_STEP`` at a
    time up to its end, or past ``limit`` bytes (``SampleTooLarge``, having held at most that)."""
    if size:
        return os.pread(fd, size, 0)
    chunks = []
    total = 0
    while chunk := os.read(fd, READ_STEP if limit is None else min(READ_STEP, limit + 1 - total)):
        chunks.append(chunk)
        total += len(chunk)
        if limit is not None and total > limit:
            raise SampleTooLarge(what, None, limit)
    return b"".join(chunks)
