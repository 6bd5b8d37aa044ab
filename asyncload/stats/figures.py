"""Where the time goes: counters for each stage, levels over time, and the bottleneck they point to.

Cheap enough to be always on: each event costs a clock read and an uncontended lock. Busy
seconds of a stage add up the time its items spent in it: for reads that overlap on the event
loop this exceeds wall time, which is the point: it shows how much waiting was hidden.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .gil import GilProbe

STAGES = ("read", "decode", "write", "copy")  # copy: host-to-device, with device="cuda"


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
    """A sample that failed: which item, in which stage, and why."""

    item: object
    stage: str
    error: str


LEVELS = ("reads_in_flight", "decodes_running", "batches_ready", "producer_waiting")


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
        self.failures: list[Failure] = []
        self._active_seconds = 0.0
        self._active_cpu = 0.0
        self._active_system_cpu = 0.0
        self._running_since: tuple[float, float, float] | None = None
        self._lock = threading.Lock()
        self._gil = GilProbe()
        self._callback: tuple[float, Callable[[dict[str, Any]], None]] | None = None
        self._last_callback = time.perf_counter()

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
            self.levels[name].change(delta, time.perf_counter())

    def add_retry(self) -> None:
        with self._lock:
            self.retries += 1

    def add_failure(self, item: object, stage: str, error: BaseException) -> None:
        with self._lock:
            self.failures.append(Failure(item, stage, f"{type(error).__name__}: {error}"))

    def add_batch(self, samples: int, waited: float) -> None:
        with self._lock:
            self.batches += 1
            self.samples += samples
            self.consumer_wait_seconds += waited
        self._maybe_call_back()

    def run_started(self) -> None:
        with self._lock:
            self._running_since = (time.perf_counter(), time.process_time(), _system_cpu_seconds())
        self._gil.start()

    def run_stopped(self) -> None:
        self._gil.stop()
        with self._lock:
            if self._running_since is not None:
                wall, cpu, system_cpu = self._running_since
                self._active_seconds += time.perf_counter() - wall
                self._active_cpu += time.process_time() - cpu
                self._active_system_cpu += _system_cpu_seconds() - system_cpu
                self._running_since = None

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

    def as_dict(self) -> dict[str, Any]:
        """Plain numbers (and the bottleneck's name), for training logs or TensorBoard."""
        with self._lock:
            now = time.perf_counter()
            active, cpu, system_cpu = self._active_seconds, self._active_cpu, self._active_system_cpu
            if self._running_since is not None:
                active += now - self._running_since[0]
                cpu += time.process_time() - self._running_since[1]
                system_cpu += _system_cpu_seconds() - self._running_since[2]
            figures: dict[str, Any] = {}
            for name, stage in self.stages.items():
                figures.update({f"{name}/items": stage.items, f"{name}/seconds": stage.seconds, f"{name}/bytes": stage.bytes})
            figures["decode/cpu_seconds"] = self.stages["decode"].cpu_seconds
            figures["gil/late_ms"] = self._gil.mean_late_ms()
            for name, level in self.levels.items():
                figures[f"{name}/mean"] = level.area_until(now) / active if active else 0.0
                figures[f"{name}/peak"] = level.peak
            figures.update(
                batches=self.batches,
                samples=self.samples,
                consumer_wait_seconds=self.consumer_wait_seconds,
                retries=self.retries,
                failures=len(self.failures),
                active_seconds=active,
                cpu_seconds=cpu,
                other_processes_cpu_seconds=max(0.0, system_cpu - cpu),
                cpu_cores=_usable_cores(),
                **self.limits,
            )
        figures["bottleneck"] = diagnose(figures)[0]
        return figures

    def report(self) -> str:
        """A compact table of the figures, and the bottleneck with its evidence."""
        f = self.as_dict()
        active = max(f["active_seconds"], 1e-9)
        lines = [f"{'stage':<8}{'items':>9}{'busy s':>9}{'ms/item':>9}{'MB':>9}"]
        for name in STAGES:
            items, seconds = f[f"{name}/items"], f[f"{name}/seconds"]
            if items:
                lines.append(f"{name:<8}{items:>9}{seconds:>9.2f}{1000 * seconds / items:>9.2f}{f[f'{name}/bytes'] / 1e6:>9.1f}")
        lines.append(
            f"in flight (mean/peak/limit): reads {f['reads_in_flight/mean']:.1f}/{f['reads_in_flight/peak']}/{f['io_concurrency']}, "
            f"decodes {f['decodes_running/mean']:.1f}/{f['decodes_running/peak']}/{f['num_threads']}, "
            f"batches ready {f['batches_ready/mean']:.1f}/{f['batches_ready/peak']}/{f['prefetch']}"
        )
        lines.append(
            f"consumer: {f['batches']} batches, {f['samples']} samples in {active:.2f} s "
            f"({f['samples'] / active:.0f}/s), waited {100 * f['consumer_wait_seconds'] / active:.0f} % of the time; "
            f"CPU {f['cpu_seconds'] / active:.2f} cores; retries {f['retries']}, failures {f['failures']}"
        )
        name, evidence = diagnose(f)
        lines.append(f"bottleneck: {name}: {evidence}")
        return "\n".join(lines)


def _system_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent busy (Linux's /proc/stat), or 0 where unknown:
    tells contention by other processes from threads waiting on the GIL."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()[1:]
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return 0.0


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


GIL_LATE_MS = 0.5  # the probe's mean lateness past which the GIL is busy (free: ~0.1 ms)


def _gil_evidence(f: dict[str, Any], cores_used: float, idle_cores: float, late: float, decode_cores: float,
                  turns: bool) -> str:
    """What says the GIL is the limit, who holds it, and the remedy."""
    who = ("the decode runs Python code that holds it, so the decode threads take turns"
           if turns or decode_cores >= 0.5 else
           f"the decode threads got only {decode_cores:.2f} cores in decode, so the Python holding it is the "
           f"pipeline's own per sample, or the training step")
    return (f"the process used {cores_used:.2f} of {f['cpu_cores']} cores with {idle_cores:.1f} idle while the loop "
            f"waited, and a thread waking every 5 ms waited {late:.2f} ms on average for the GIL (about 0.1 when "
            f"it is free): Python under one GIL is the limit; {who}. More threads cannot help: processes=N runs the "
            f"pipeline in N processes, each with its own GIL")


def diagnose(f: dict[str, Any]) -> tuple[str, str]:
    """Names what limits the pipeline, from ``LoaderStats.as_dict()`` figures, with the evidence.

    consumer: the user's step (the loop rarely waits: the loader is ahead);
    GIL: cores idle while the loop waits, and a probe thread waits for the GIL (``gil.py``) or
    more than one decode thread is in decode at a time yet together they get about one core: Python
    under one GIL (the pipeline's per sample, a decode that runs Python, the training step) is the
    limit, whatever the threads; ``processes=`` runs the pipeline under N GILs;
    decode CPU: decode threads are busy and use the cores (or share them with other processes);
    storage: reads are in flight at the cap (raise io_concurrency), or reads take far longer
    than decoding while decode threads idle;
    memory: reads and decodes idle while the pipeline sits at its prefetch window: batches of
    buffers are the limit (raise prefetch).
    """
    active = f["active_seconds"]
    if not active or not f["batches"]:
        return "unknown", "no batch delivered yet"
    waited = f["consumer_wait_seconds"] / active
    decode_busy = f["decodes_running/mean"] / f["num_threads"]
    reads = f"reads in flight averaged {f['reads_in_flight/mean']:.1f} of {f['io_concurrency']}"
    cores_used = f["cpu_seconds"] / active
    others = f["other_processes_cpu_seconds"] / active
    if waited < 0.1:
        return "consumer", (f"the loop waited for data {100 * waited:.0f} % of the time; "
                            f"{f['batches_ready/mean']:.1f} batches of {f['prefetch']} were ready on average")
    idle_cores = f["cpu_cores"] - cores_used - others
    decodes = f["decodes_running/mean"]
    decode_cores = f["decode/cpu_seconds"] / active  # the CPU the threads in decode actually got
    on_cpu = decode_cores / decodes if decodes else 1.0  # share of in-decode time on a CPU: < 1 waits on a lock
    late = f.get("gil/late_ms", 0.0)
    # Threads in decode taking turns: together about one core (the GIL's), each off the CPU most of
    # the time. Off the CPU with no CPU at all is a decode that waits GIL-free (a sleep, a GPU).
    turns = decodes >= 1.1 and 0.5 <= decode_cores < 1.25 and on_cpu < 0.85
    # A late probe alone may be the OS's scheduling on a loaded machine: a busy GIL also means the
    # process keeps about a core busy with the Python holding it.
    gil_busy = late >= GIL_LATE_MS and cores_used >= 0.8
    if f["cpu_cores"] >= 2 and idle_cores > 0.5 and (gil_busy or (f["num_threads"] >= 2 and turns)):
        return "GIL", _gil_evidence(f, cores_used, idle_cores, late, decode_cores, turns)
    if decode_busy > 0.75 or (decode_busy > 0.4 and idle_cores < 0.5):
        return "decode CPU", (f"decode threads were busy {100 * decode_busy:.0f} % of the time; the process used "
                              f"{cores_used:.2f} and other processes {others:.2f} of {f['cpu_cores']} cores")
    if f["reads_in_flight/mean"] > 0.75 * f["io_concurrency"]:
        return "storage", f"{reads} (the cap) while decode threads were busy {100 * decode_busy:.0f} % of the time"
    if f["producer_waiting/mean"] > 0.5 and decode_busy < 0.25:
        return "memory", (f"the pipeline sat at its prefetch window {100 * f['producer_waiting/mean']:.0f} % of the "
                          f"time with decode threads busy {100 * decode_busy:.0f} % and {reads}: raise prefetch")
    if f["read/seconds"] > 2 * f["decode/seconds"]:
        return "storage", f"reads took {f['read/seconds']:.1f} s against {f['decode/seconds']:.1f} s of decode; {reads}"
    return "mixed", f"decode threads busy {100 * decode_busy:.0f} %, {reads}, the loop waited {100 * waited:.0f} %"
