"""A sample that failed to decode from a damaged cached copy is decoded again from a fresh one.

The shard cache checks a copy's checksum once per process, at its first use; a copy damaged after
that (or by bit rot, which keeps the file's modification time) would fail its samples' decodes
for the rest of the run. So a decode failure of a sample read through a shard stream with a cache
goes to the event loop before it is reported: the stream checks the copy the sample came from
(``ShardStream.refetched``) and, if it was damaged, reads the sample once more from a fresh
download, and the row is decoded again; else the failure stands. Only failures take this path.
"""

from __future__ import annotations

import asyncio
from typing import Any, Coroutine, Protocol

from ..errors import SampleError
from ..settings import LoaderSettings
from ..sources.shards import ShardSample
from .jobs import Row, Work, split
from .run_state import RunState
from .threads import LoopThread


class Rows(Protocol):
    """What a retry needs of the pipeline (``pipeline.py``, which imports this module)."""

    s: LoaderSettings
    loop_thread: LoopThread

    def row_failed(self, work: Work, row: int, error: SampleError) -> None: ...

    def rows_done(self, work: Work, count: int) -> None: ...

    def spawn(self, run: RunState, coroutine: Coroutine[Any, Any, None]) -> Any: ...


class Refetch:
    """``row_failed`` for a pipeline's ``RowFiller``: the pipeline's own, after the retry above."""

    def __init__(self, pipeline: Rows) -> None:
        self.p = pipeline

    def row_failed(self, work: Work, row: int, error: SampleError) -> None:
        """On any thread: a row's failure; a decode failure of a cached shard sample is retried."""
        stream = work.run.stream
        if error.stage != "decode" or stream is None or stream.cache is None or not isinstance(error.item, ShardSample):
            self.p.row_failed(work, row, error)
        else:
            self.p.loop_thread.call_soon(self._start, work, row, error)

    def _start(self, work: Work, row: int, error: SampleError) -> None:
        if self.p.spawn(work.run, self._retry(work, row, error)) is None:
            self.p.rows_done(work, 1)  # the run is stopped: the row ends unreported

    async def _retry(self, work: Work, row: int, error: SampleError) -> None:
        """Reads the sample again if its copy was damaged and hands it to a decode job; the row
        ends once: decoded again, failed (the first error, or the new read's), or cancelled."""
        state, key = work.run, error.item
        state.jobs.hold(work)
        try:
            data = await state.stream.refetched(key.index)
            if data is None:
                self.p.row_failed(work, row, error)
                return
            _, label = split(self.p.s.source, self.p.s.labelled, key.index)
            state.jobs.add(work, [Row(row, key, label, key.index, data)])
        except asyncio.CancelledError:
            self.p.rows_done(work, 1)
            raise
        except SampleError as failure:
            self.p.row_failed(work, row, failure)
        except Exception as failure:
            self.p.row_failed(work, row, SampleError(key, "read", failure))
        finally:
            state.jobs.release(work)
