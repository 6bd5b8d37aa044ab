"""Where the time goes: counters for each stage, levels over time, and the bottleneck they point to.

Cheap enough to be always on: each event costs a clock read and an uncontended lock. Busy
seconds of a stage add up the time its items spent in it: for reads that overlap on the event
loop this exceeds wall time, which is the point: it shows how much waiting was hidden.
``report()``'s text is ``report_text``, here too.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

import numpy as np

from ..errors import describe, where
from ..redact import shown
from .machine import GilProbe, system_cpu_seconds, usable_cores
from .snapshot import LEVELS, STAGES, LevelFigures, StageFigures, StatsSnapshot
from .trace import Tracer
from .verdict import diagnose


# ----- report() -----
# ``loader.stats.report()``'s text: a table of the stages, what was in flight, the consumer's
# figures, the bottleneck with its evidence (``verdict.py``) and where the pipeline runs.

def report_text(s: StatsSnapshot, processes_choice: str | None, gpu_decode_choice: str | None = None,
                decoded_on_cpu_why: dict[str, int] | None = None) -> str:
    """The report of snapshot ``s``; ``processes_choice``: the default's line, if it has one;
    ``gpu_decode_choice``: the GPU decode stage's split and why, if it ran; ``decoded_on_cpu_why``:
    the samples it left to the CPU path, by reason."""
    active = max(s.active_seconds, 1e-9)
    lines = [f"{'stage':<8}{'items':>9}{'busy s':>9}{'ms/item':>9}{'MB':>9}"]
    for name in STAGES:
        stage = getattr(s, name)
        if stage.items:
            lines.append(f"{name:<8}{stage.items:>9}{stage.seconds:>9.2f}{1000 * stage.seconds / stage.items:>9.2f}"
                         f"{stage.bytes / 1e6:>9.1f}")
    reads, decodes, ready = s.reads_in_flight, s.decodes_running, s.batches_ready
    lines.append(
        f"in flight (mean/peak/limit): reads {reads.mean:.1f}/{reads.peak}/{s.io_concurrency}, "
        f"decodes {decodes.mean:.1f}/{decodes.peak}/{s.num_threads}, "
        f"batches ready {ready.mean:.1f}/{ready.peak}/{s.prefetch}"
    )
    lines.append(
        f"consumer: {s.batches} batches, {s.samples} samples in {active:.2f} s "
        f"({s.samples / active:.0f}/s), waited {100 * s.consumer_wait_seconds / active:.0f} % of the time; "
        f"CPU {s.cpu_seconds / active:.2f} cores; retries {s.retries} ({s.retry_wait_seconds:.1f} s waiting), failures {s.failures}"
    )
    if gpu_decode_choice is not None:
        lines.append(gpu_decode_choice)
    if s.decoded_on_cpu:
        why = "".join(f"; {reason}: {count}" for reason, count in sorted((decoded_on_cpu_why or {}).items()))
        lines.append(f"GPU decoder: {s.decoded_on_cpu} of {s.decode.items} samples took its CPU path{why}")
    name, evidence = diagnose(s.as_dict())
    lines.append(f"bottleneck: {name}: {evidence}")
    if processes_choice is not None:
        lines.append(processes_choice)
    return "\n".join(lines)


TRACED_LEVELS = ("reads_in_flight", "batches_ready")  # drawn as counters in a trace


@dataclass
class StageStats:
    """One stage: how many items passed, how long they spent in it, how many bytes they carried."""

    items: int = 0
    seconds: float = 0.0
    bytes: int = 0
    cpu_seconds: float = 0.0  # CPU time of the threads doing the work (decode only)


@dataclass
class Level:
    """A quantity that rises and falls (reads in flight, decodes running, batches ready): its
    time-weighted mean and its peak, so a report can say "reads in flight averaged 63.8 of 64"."""

    value: int = 0
    peak: int = 0
    area: float = 0.0  # integral of value over time
    since: float = field(default_factory=time.perf_counter)

    def change(self, delta: int, now: float) -> None:
        self.area += self.value * (now - self.since)
        self.since = now
        self.value += delta
        self.peak = max(self.peak, self.value)

    def area_until(self, now: float) -> float:
        return self.area + self.value * (now - self.since)


@dataclass
class Failure:
    """A sample that failed: which item, in which stage, why, and in which epoch (the list spans
    epochs; ``max_failures`` counts one) and on which rank (None in a job of one rank).
    ``item`` is the item itself (to retry it); ``error`` and the text forms are redacted and
    bounded (see ``redact``), so a list of failures can go to a log."""

    item: object
    stage: str
    error: str
    epoch: int | None = None
    rank: int | None = None

    def __str__(self) -> str:
        return f"{shown(self.item)} failed at {self.stage}{where(self.epoch, self.rank)}: {self.error}"

    def __repr__(self) -> str:
        return (f"Failure(item={shown(self.item)}, stage={self.stage!r}, error={self.error!r}, epoch={self.epoch}, "
                f"rank={self.rank})")


class LoaderStats:
    """Figures for the loader's lifetime, updated from the event loop, the decode threads and
    the user's thread. Means are over the time an epoch was running, not the idle time between."""

    def __init__(self, io_concurrency: int = 1, num_threads: int = 1, prefetch: int = 1) -> None:
        self.limits = {"io_concurrency": io_concurrency, "num_threads": num_threads, "prefetch": prefetch}
        self.stages = {name: StageStats() for name in STAGES}
        self.levels = {name: Level() for name in LEVELS}
        self.batches = 0
        self.samples = 0
        self.consumer_wait_seconds = 0.0
        self.retries = 0
        self.retry_wait_seconds = 0.0  # time reads waited between their tries (the retry budget spent)
        self.decoded_on_cpu = 0  # samples a batched GPU decoder sent to its CPU path
        self.decoded_on_cpu_why: dict[str, int] = {}  # those samples by reason ("not a JPEG": 12, ...)
        self.aside_bytes = 0  # values kept aside (batch/ragged.py): pickled per sample with processes=N
        self.failures: list[Failure] = []
        self._active_seconds = 0.0
        self._active_cpu = 0.0
        self._active_system_cpu = 0.0
        self._running_since: tuple[float, float, float] | None = None
        self._lock = threading.Lock()
        self._gil = GilProbe()
        self._callback: tuple[float, Callable[[dict[str, Any]], None]] | None = None
        self._last_callback = time.perf_counter()
        self.tracer: Tracer | None = None  # with trace=: the timeline (see trace.py)
        self.processes_choice: str | None = None  # processes=None: where the pipeline runs, and why
        self.gpu_decode_choice: str | None = None  # the GPU decode stage: its split of the batches, and why
        self._step: tuple[int, float] | None = None  # (batches handed out, the user's last step's seconds)
        self._handed_out_at: float | None = None
        self._source_counts: tuple[tuple[str, ...], np.ndarray] | None = None  # a mix's names, samples each

    # ----- updates from the pipeline -----

    @property
    def read(self) -> StageStats:
        return self.stages["read"]

    @property
    def decode(self) -> StageStats:
        return self.stages["decode"]

    def add(self, stage: str, seconds: float, nbytes: int = 0, cpu_seconds: float = 0.0, items: int = 1) -> None:
        """Counts ``items`` that spent ``seconds`` in ``stage`` (decode jobs report a chunk at once)."""
        with self._lock:
            stats = self.stages[stage]
            stats.items += items
            stats.seconds += seconds
            stats.bytes += nbytes
            stats.cpu_seconds += cpu_seconds

    def level(self, name: str, delta: int) -> None:
        with self._lock:
            level = self.levels[name]
            level.change(delta, time.perf_counter())
            value = level.value
        if self.tracer is not None and name in TRACED_LEVELS:
            self.tracer.counter(name, value)

    def add_retry(self, wait: float = 0.0) -> None:
        """Counts a retry that first waits ``wait`` seconds."""
        with self._lock:
            self.retries += 1
            self.retry_wait_seconds += wait

    def add_aside(self, nbytes: int) -> None:
        with self._lock:
            self.aside_bytes += nbytes

    def add_decoded_on_cpu(self, count: int, why: Mapping[str, int] | None = None) -> None:
        """``count`` samples the GPU decoder left to the CPU path; ``why``: how many for each reason."""
        with self._lock:
            self.decoded_on_cpu += count
            for reason, number in (why or {}).items():
                self.decoded_on_cpu_why[reason] = self.decoded_on_cpu_why.get(reason, 0) + number

    def add_failure(self, item: object, stage: str, error: BaseException, epoch: int | None = None,
                    rank: int | None = None) -> None:
        text = describe(error)
        with self._lock:
            self.failures.append(Failure(item, stage, text, epoch, rank))
        if self.tracer is not None:
            self.tracer.instant("failure", {"sample": item, "stage": stage, "error": text, "epoch": epoch,
                                            "rank": rank})

    def add_batch(self, samples: int, waited: float, number: int | None = None) -> None:
        """Batch ``number`` of ``samples`` was handed out after the consumer ``waited`` for it."""
        now = time.perf_counter()
        with self._lock:
            self.batches += 1
            self.samples += samples
            self.consumer_wait_seconds += waited
            if self._handed_out_at is not None:  # the user's step: from the last hand-out to this next()
                self._step = (self.batches, max(0.0, now - waited - self._handed_out_at))
            self._handed_out_at = now
        if self.tracer is not None:
            self.tracer.span("wait for batch", now - waited, now, f"batch {number}")
        self._maybe_call_back()

    def last_step(self) -> tuple[int, float] | None:
        """(batches handed out, seconds): the training step's time between the last two batches,
        from one hand-out to the next ``next()`` call; None before two batches."""
        with self._lock:
            return self._step

    def add_sources(self, names: tuple[str, ...], source_ids: np.ndarray) -> None:
        """A mix's batch was handed out with these source numbers: one ``bincount`` a batch."""
        counts = np.bincount(source_ids, minlength=len(names))
        with self._lock:
            if self._source_counts is None:
                self._source_counts = (names, np.zeros(len(names), dtype=np.int64))
            self._source_counts[1][:] += counts[: len(names)]

    @property
    def sources(self) -> dict[str, int]:
        """With a mixed source: samples handed out per source name (empty otherwise)."""
        with self._lock:
            if self._source_counts is None:
                return {}
            names, counts = self._source_counts
            return dict(zip(names, counts.tolist()))

    def run_started(self) -> None:
        with self._lock:
            self._running_since = (time.perf_counter(), time.process_time(), system_cpu_seconds())
        self._gil.start()

    def run_stopped(self) -> None:
        self._gil.stop()
        with self._lock:
            self._handed_out_at = None  # the time until the next pass's first batch is not a step
            if self._running_since is not None:
                wall, cpu, system_cpu = self._running_since
                self._active_seconds += time.perf_counter() - wall
                self._active_cpu += time.process_time() - cpu
                self._active_system_cpu += system_cpu_seconds() - system_cpu
                self._running_since = None

    def carry(self, earlier: "LoaderStats") -> None:
        """Goes on from ``earlier``'s figures (``processes=None`` moved the pipeline to other
        pipelines, with stats of their own): its counts, active time, CPU and levels' integrals are
        added to these, and its failures are these, so the figures stay the loader's lifetime's."""
        figures = earlier.snapshot()
        with self._lock:
            for name, stage in self.stages.items():
                done = getattr(figures, name)
                stage.items, stage.seconds, stage.bytes = (stage.items + done.items, stage.seconds + done.seconds,
                                                           stage.bytes + done.bytes)
                stage.cpu_seconds += done.cpu_seconds
            for name, level in self.levels.items():
                level.area += getattr(figures, name).mean * figures.active_seconds
                level.peak = max(level.peak, getattr(figures, name).peak)
            self.batches += figures.batches
            self.samples += figures.samples
            self.consumer_wait_seconds += figures.consumer_wait_seconds
            self.retries += figures.retries
            self.retry_wait_seconds += figures.retry_wait_seconds
            self.decoded_on_cpu += figures.decoded_on_cpu
            for reason, number in earlier.decoded_on_cpu_why.items():
                self.decoded_on_cpu_why[reason] = self.decoded_on_cpu_why.get(reason, 0) + number
            self._active_seconds += figures.active_seconds
            self._active_cpu += figures.cpu_seconds
            self._active_system_cpu += figures.cpu_seconds + figures.other_processes_cpu_seconds
        self.failures = earlier.failures

    # ----- reading the figures -----

    def on_interval(self, seconds: float, callback: Callable[[dict[str, Any]], None] | None) -> None:
        """Calls ``callback(stats.as_dict())`` from the training loop's thread, at most every
        ``seconds`` (checked when a batch is handed out); ``None`` stops it."""
        self._callback = None if callback is None else (seconds, callback)

    def _maybe_call_back(self) -> None:
        if self._callback is None:
            return
        seconds, callback = self._callback
        now = time.perf_counter()
        if now - self._last_callback >= seconds:
            self._last_callback = now
            callback(self.as_dict())

    def snapshot(self) -> StatsSnapshot:
        """The figures now, typed (see ``StatsSnapshot`` for what each one means)."""
        with self._lock:
            now = time.perf_counter()
            active, cpu, system_cpu = self._active_seconds, self._active_cpu, self._active_system_cpu
            if self._running_since is not None:
                active += now - self._running_since[0]
                cpu += time.process_time() - self._running_since[1]
                system_cpu += system_cpu_seconds() - self._running_since[2]
            stages = {name: StageFigures(s.items, s.seconds, s.bytes, s.cpu_seconds if name == "decode" else 0.0)
                      for name, s in self.stages.items()}
            levels = {name: LevelFigures(level.area_until(now) / active if active else 0.0, level.peak)
                      for name, level in self.levels.items()}
            snapshot = StatsSnapshot(
                **stages, **levels, gil_late_ms=self._gil.mean_late_ms(), batches=self.batches, samples=self.samples,
                consumer_wait_seconds=self.consumer_wait_seconds, retries=self.retries,
                retry_wait_seconds=self.retry_wait_seconds, failures=len(self.failures),
                active_seconds=active, cpu_seconds=cpu, other_processes_cpu_seconds=max(0.0, system_cpu - cpu),
                cpu_cores=usable_cores(), decoded_on_cpu=self.decoded_on_cpu, aside_bytes=self.aside_bytes,
                **self.limits,
            )
        return with_verdict(snapshot)

    def as_dict(self) -> dict[str, Any]:
        """Plain numbers (and the bottleneck's name), for training logs or TensorBoard; with a
        mixed source, ``"mix/<name>/samples"`` too; with the GPU decode stage,
        ``"decoded_on_cpu/<reason>"`` for each reason samples took the CPU path."""
        figures = self.snapshot().as_dict()
        figures.update({f"mix/{name}/samples": count for name, count in self.sources.items()})
        with self._lock:
            figures.update({f"decoded_on_cpu/{reason}": count for reason, count in self.decoded_on_cpu_why.items()})
        return figures

    def report(self) -> str:
        """A compact table of the figures, and the bottleneck with its evidence (``report_text``, above)."""
        with self._lock:
            why = dict(self.decoded_on_cpu_why)
        return report_text(self.snapshot(), self.processes_choice, self.gpu_decode_choice, why)


def with_verdict(snapshot: StatsSnapshot) -> StatsSnapshot:
    """``snapshot`` with its bottleneck named."""
    return replace(snapshot, bottleneck=diagnose(snapshot.as_dict())[0])
