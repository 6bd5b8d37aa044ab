"""What a pipeline needs to move samples, in this process or (pickled) in a child process: the
source, how to read and decode it, and its share of the threads and reads. The epoch's policy is
in ``epoch/settings.py``, which makes these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..io.reader import Reader


@dataclass
class PipelineSettings:
    """What moves samples: the source, how to read and decode it, and the resources for it
    (a child process gets its share of ``num_threads`` and ``io_concurrency``). No policy: which
    samples go where, and what a failure means, are the driver's (``driver.py``)."""

    source: Sequence[Any]
    read: Callable[[Any], Any] | bool | None
    decode: Callable[[Any], Any]
    labelled: bool
    batch_size: int
    num_threads: int
    io_concurrency: int
    thread_limit: int | None  # with num_threads="auto": decode threads that may work at once
    storage_options: dict[str, Any] | None
    read_timeout: float
    read_retries: int | None
    read_retry_seconds: float
    max_sample_bytes: int | None
    decode_timeout: float | None = None  # seconds a decode may run before its sample fails (slots.py)
    trace_events: int | None = None  # with trace=: a child records its events and sends them with its answers

    async def reader(self, loop: Any, stats: Any) -> Reader:
        """The pipeline's reader (made on its event loop, ``loop``)."""
        return Reader(loop, storage_options=self.storage_options, timeout=self.read_timeout, retries=self.read_retries,
                      io_concurrency=self.io_concurrency, stats=stats, user_read=self.read if callable(self.read) else None,
                      retry_seconds=self.read_retry_seconds, max_bytes=self.max_sample_bytes)


def share(total: int, processes: int) -> int:
    """One process's part of a total (rounded up: none gets zero); the total in-process."""
    return total if processes <= 1 else max(1, math.ceil(total / processes))
