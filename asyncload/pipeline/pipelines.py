"""What the driver talks to: its pipelines. ``LocalPipeline`` is the one pipeline in this process;
``procs/parent.py``'s ``ProcessPool`` is N of them in child processes. Both take the same
messages (``messages.py``), hand out buffers from one kind of ring (``take``, ``configure``,
numbered buffers) and count in one kind of stats, so the driver cannot tell them apart. A
``Backend`` is one of them with its window, as ``backend.py`` builds it.
"""

from __future__ import annotations

import queue
import time
import warnings
from dataclasses import dataclass
from typing import Any, Protocol

from ..batch.buffers import BatchBuffer, BufferRing
from ..device import DeviceStage
from ..gates import Gate
from ..settings import LoaderSettings
from ..stats.loader_stats import LoaderStats
from ..cache.items import KeptCaches
from .messages import Stop, Stopped
from .pipeline import Pipeline

ENDED = "this iteration has ended: the loader was closed or iterated anew"
STOP_TIMEOUT_S = 20.0  # how long a stop waits for the threads: a read's timeout is on its own threads
POLL_S = 0.1  # how often a wait for an answer looks whether the run was stopped from another thread


class Pipelines(Protocol):
    """The driver's pipelines: ``count`` of them, the ring their buffers come from, the stats
    they count in (with the tracer, if any)."""

    count: int
    ring: Any  # take() -> BatchBuffer, configure(layout, capacity), layout
    stats: LoaderStats

    def new_run(self) -> int: ...

    def send(self, index: int, message: Any) -> None: ...

    def receive(self, run: int, block: bool = True) -> Any: ...

    def stop_run(self, run: int, buffers: list[BatchBuffer], timeout: float | None) -> bool: ...

    def set_limits(self, num_threads: int | None, io_concurrency: int | None) -> None: ...

    def close(self) -> None: ...


@dataclass
class Backend:
    """What moves the samples of every pass, built once (``backend.py``): the pipelines, with
    their ring and stats, and the ``window`` of batches the driver keeps under way for them.
    Nothing of it is replaced after it is built; a loader that changes how it moves samples
    builds another and hands over between two batches."""

    pipelines: Pipelines
    window: int
    processes: int  # 0: the one pipeline in this process
    device_stage: DeviceStage | None = None  # the loader's, with a CUDA device: copies batches there

    @property
    def ring(self) -> Any:
        return self.pipelines.ring

    @property
    def stats(self) -> LoaderStats:
        return self.pipelines.stats

    def close(self) -> None:
        """Stops the pipelines (the child processes) and frees the ring's buffers."""
        self.pipelines.close()


class LocalPipeline:
    """The pipeline in this process: one per run, so that leaving the loop leaves no thread
    running. Its answers come through a queue the user's thread reads."""

    count = 1

    def __init__(self, settings: LoaderSettings, ring: BufferRing, stats: LoaderStats) -> None:
        self.settings = settings
        self.ring = ring
        self.stats = stats
        # What the tuner moves, for this run and the next ones: how many decode threads work
        # (with num_threads="auto"), how many reads are in flight.
        self.gate = Gate(settings.num_threads) if settings.auto_threads else None
        self.io_concurrency = settings.io_concurrency
        self._pipelines: dict[int, Pipeline] = {}  # by run: a stop cut short is finished later
        self._answers: queue.SimpleQueue = queue.SimpleQueue()
        self._runs = 0
        self._ended: set[int] = set()  # runs stopped: a wait for their answers ends
        self.kept = KeptCaches()  # what the caches of one pass keep for the next

    def new_run(self) -> int:
        self._runs += 1
        self._answers = queue.SimpleQueue()
        self._pipelines[self._runs] = Pipeline(self.settings, self.ring.buffer, self._answers.put, self.stats,
                                               gate=self.gate, io_concurrency=self.io_concurrency, kept=self.kept)
        return self._runs

    def send(self, index: int, message: Any) -> None:
        pipeline = self._pipelines.get(message.run)
        if pipeline is None or message.run in self._ended:
            raise RuntimeError(ENDED)  # stopped from another thread (close()) meanwhile
        pipeline.handle(message)

    def receive(self, run: int, block: bool = True) -> Any:
        """The next answer about ``run`` (None at once without ``block`` if there is none)."""
        answers = self._answers
        while True:
            if run in self._ended:
                raise RuntimeError(ENDED)
            try:
                message = answers.get(timeout=POLL_S) if block else answers.get_nowait()
            except queue.Empty:
                if not block:
                    return None
                pipeline = self._pipelines.get(run)
                dead = pipeline is not None and not pipeline.thread.is_alive()
                if run in self._ended:  # looked at after the thread: a stop (close()) marks it first
                    raise RuntimeError(ENDED)
                if dead and answers.empty():
                    raise RuntimeError("the loader's event loop stopped unexpectedly")
                continue
            if not isinstance(message, Stopped) and message.run == run:
                return message

    def stop_run(self, run: int, buffers: list[BatchBuffer], timeout: float | None) -> bool:
        """Stops the run's pipeline and waits (at most ``timeout``) for its threads; then the
        buffers it may have written go back. False, with a warning, if threads are still
        running: a later call finishes the job."""
        self._ended.add(run)
        pipeline = self._pipelines.get(run)
        if pipeline is None:
            return True
        pipeline.handle(Stop(run))
        timeout = STOP_TIMEOUT_S if timeout is None else timeout
        alive = [thread.name for thread in pipeline.close(time.monotonic() + timeout)]
        if alive:
            warnings.warn(f"asyncload: {len(alive)} threads still running {timeout:g} s after stop() "
                          f"({', '.join(alive)}); a later stop() or close() finishes the job", RuntimeWarning)
            return False
        for buffer in buffers:
            buffer.give_back()
        self._pipelines.pop(run, None)  # another thread may have finished the same stop
        return True

    def set_limits(self, num_threads: int | None, io_concurrency: int | None) -> None:
        """The tuner's settings: threads through the shared gate, reads in flight for this run
        and the next ones."""
        if num_threads is not None and self.gate is not None:
            self.gate.set_limit(num_threads)
        if io_concurrency is not None:
            self.io_concurrency = io_concurrency
            pipeline = self._pipelines.get(self._runs)
            if pipeline is not None:
                pipeline.set_limits(None, io_concurrency)

    def close(self) -> None:
        """Frees the ring's buffers and closes what the caches kept (the runs were stopped before)."""
        self.ring.clear()
        self.kept.close()
