"""One run's part of a pipeline, and when its stop may be confirmed.

A run (one iteration over an epoch) has its own decode jobs, shard stream, fills and read
tasks in the pipeline; runs overlap only while an old one is stopping. ``Stopped`` goes back
to the driver exactly once, when the run's reads are cancelled and no row of it is under way:
only then may its buffers be reused.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from ..sources.shard_stream import ShardStream
from .batched import BatchJobs
from .jobs import RowFiller, RowJobs, Work
from .messages import Failed


@dataclass
class RunState:
    """One run's part of the pipeline: its decoder jobs, its shard stream, its fills and tasks."""

    run: int
    filler: RowFiller
    jobs: RowJobs | BatchJobs
    stream: ShardStream | None
    active: int = 0  # fills not yet complete
    stopped: bool = False  # no job of the run starts (set on the driver's thread)
    closed: bool = False  # its reads are cancelled and its stream closed (on the loop)
    confirmed: bool = False  # Stopped was sent
    by_id: dict[int, Work] = field(default_factory=dict)
    tasks: set[asyncio.Task] = field(default_factory=set)
    probed: dict[int, tuple[Any, Any]] = field(default_factory=dict)  # index -> (key, labelled sample)

    def track(self, task: asyncio.Task, send: Any) -> None:
        """Keeps the run's task until it ends; one that raised is reported with ``Failed``."""
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        task.add_done_callback(lambda done: None if done.cancelled() or done.exception() is None
                               else send(Failed(self.run, done.exception())))

    def stop_jobs(self) -> None:
        """Under the pipeline's lock: no job of the run starts any more (the decode threads look
        at ``cancelled``)."""
        self.stopped = True
        for work in self.by_id.values():
            work.cancelled = True

    def confirms(self) -> bool:
        """Under the pipeline's lock: whether this is the moment to confirm the run's stop (its
        reads are cancelled, no row is under way, and it was not confirmed yet)."""
        if self.closed and self.active == 0 and not self.confirmed:
            self.confirmed = True
            return True
        return False

    async def close(self, lock: Any) -> bool:
        """On the loop: cancels the run's reads and closes its shard stream; True when the stop
        may be confirmed now (else the last row to end confirms it: ``confirms``). ``lock``:
        the pipeline's, shared with the decode threads."""
        with lock:  # the control thread's mark may have come before the run's Start
            self.stop_jobs()
        # A task cancelled before its first step never enters its body, its ``finally`` neither
        # (Python raises CancelledError at its first line): a read task's row would never end,
        # nor the run's stop be confirmed, and its read slot stay taken. That happens when the
        # mark above comes late (a Start, Fill and Stop taken in one burst: the fill's tasks made
        # after the mark found no run). No task of the run is made from here on (``stopped``:
        # ``Pipeline.spawn`` refuses), and one turn of the loop lets each one made before take
        # its first step (the loop runs callbacks in the order they were scheduled).
        await asyncio.sleep(0)
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.stream is not None:
            await self.stream.aclose()
        self.probed.clear()
        with lock:
            self.closed = True
            return self.confirms()
