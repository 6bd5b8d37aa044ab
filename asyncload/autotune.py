"""``num_threads="auto"`` and ``io_concurrency="auto"``: concurrency that follows the bottleneck.

Every second or so of running, the tuner looks at what happened since its last look. If the
training loop waited for data, it raises the knob the bottleneck points to (decode threads for
"decode CPU", reads in flight for "storage"), one step at a time, and only where the raise can
help: a thread when a core is idle to run it, reads when they fill most of their cap. If the loop has not waited for
a few looks in a row, it lowers a knob that had slack, but never below a value that once made
the loop wait (its floor): so settings settle at the smallest that keep the loop fed, and do
not oscillate. Reads in flight are also kept within a memory budget.

The decisions read no clock: ``Looks`` is told the time and the figures, and ``AutoTuner.look``
decides from them, so both are tested with numbers (``tests/test_adapt_logic.py``); ``observe``,
called at each batch, reads the clock and the stats and passes them in.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .stats.loader_stats import LoaderStats
from .stats.verdict import diagnose

MAX_IO = 1024


@dataclass
class Knob:
    """One tuned setting: its value, its bounds, and the floor below which the loop waited."""

    name: str
    value: int
    low: int
    high: int
    floor: int = 1
    apply: Callable[[int], None] | None = field(default=None, repr=False)

    def set(self, value: int) -> bool:
        value = max(self.low, min(self.high, value))
        if value == self.value:
            return False
        self.value = value
        if self.apply is not None:
            self.apply(value)
        return True


class Looks:
    """When a policy looks at the loader's stats, and what it sees then: the figures since its
    last look (``interval_figures``). Told the time (``now``, in seconds) rather than reading a
    clock. ``at_once``: the first look comes at the first chance (else an ``interval`` after
    ``now``), and it only sets the baseline: a window needs two looks."""

    def __init__(self, interval: float, now: float, at_once: bool = False) -> None:
        self.interval = interval
        self.at_once = at_once
        self.last: dict[str, Any] | None = None  # the figures of the last look
        self.last_time = now

    def due(self, now: float) -> bool:
        """Whether it is time for a look (then ``take`` one)."""
        return (self.at_once and self.last is None) or now - self.last_time >= self.interval

    def take(self, figures: dict[str, Any], now: float) -> dict[str, Any] | None:
        """A look at ``figures`` (``LoaderStats.as_dict()``) at ``now``: the window since the last
        look, or None where there is no baseline: the first look, or figures of another count of
        processes (a switch: the stats went on from another backend's)."""
        last, self.last, self.last_time = self.last, figures, now
        if last is None or last.get("processes") != figures.get("processes"):
            return None
        return interval_figures(last, figures)

    def forget(self) -> None:
        """The next look only sets a baseline (with ``at_once``, at the first chance)."""
        self.last = None


class AutoTuner:
    """Moves ``threads`` and/or ``io`` knobs from the loader's stats; see the module's docstring."""

    def __init__(self, stats: LoaderStats, threads: Knob | None, io: Knob | None, interval: float = 1.0,
                 memory_budget: int = 2**30, clock: Callable[[], float] = time.perf_counter) -> None:
        self.stats = stats
        self.knobs = {knob.name: knob for knob in (threads, io) if knob is not None}
        self.clock = clock  # seconds; a test's own, to drive ``observe`` without waiting
        self.looks = Looks(interval, clock())
        self.memory_budget = memory_budget
        self.changes: list[tuple[float, str, int, int, str]] = []  # (time, knob, old, new, why)
        self._calm_looks = 0

    @property
    def interval(self) -> float:
        """Seconds between two looks."""
        return self.looks.interval

    @interval.setter
    def interval(self, seconds: float) -> None:
        self.looks.interval = seconds

    def observe(self) -> None:
        """Called by the user's thread at each batch; decides at most once per ``interval``."""
        now = self.clock()
        if self.looks.due(now):
            self.look(self.stats.as_dict(), now)

    def look(self, figures: dict[str, Any], now: float) -> None:
        """A look at the stats' ``figures`` at time ``now``: decides from the window since the
        last look, if it ran at all."""
        window = self.looks.take(figures, now)
        if window is None or window["active_seconds"] <= 0 or window["batches"] == 0:
            return
        self._decide(window)

    def _decide(self, window: dict[str, Any]) -> None:
        waited = window["consumer_wait_seconds"] / window["active_seconds"]
        bottleneck, evidence = diagnose(window)
        if waited > 0.05:
            self._calm_looks = 0
            knob = self._knob_for(bottleneck, window)
            if knob is not None:
                knob.floor = max(knob.floor, knob.value + 1)
                step = knob.value * 2 if knob.name == "io_concurrency" else knob.value + 1
                self._change(knob, min(step, self._io_cap(window)) if knob.name == "io_concurrency" else step,
                             f"the loop waited {100 * waited:.0f} %: {bottleneck}: {evidence}")
            return
        self._calm_looks += 1
        if self._calm_looks >= 3:
            self._calm_looks = 0
            self._lower_one(window)

    def _knob_for(self, bottleneck: str, window: dict[str, Any]) -> Knob | None:
        """The knob whose raise can shorten the wait: decode threads while they are busy and a
        core is idle to run one more; reads in flight while they fill most of their cap. None
        when the wait comes from elsewhere (saturated cores, the event loop, a short prefetch
        window): more threads on busy cores, or a cap that reads do not reach, only add cost."""
        threads, io = self.knobs.get("num_threads"), self.knobs.get("io_concurrency")
        active = window["active_seconds"]
        idle_cores = window["cpu_cores"] - (window["cpu_seconds"] + window["other_processes_cpu_seconds"]) / active
        busy_threads = window["decodes_running/mean"] > 0.6 * window["num_threads"]
        if bottleneck in ("decode CPU", "mixed") and busy_threads and idle_cores >= 0.5:
            return threads
        if bottleneck in ("storage", "mixed") and window["reads_in_flight/mean"] > 0.75 * window["io_concurrency"]:
            return io
        return None

    def _lower_one(self, window: dict[str, Any]) -> None:
        threads, io = self.knobs.get("num_threads"), self.knobs.get("io_concurrency")
        if threads is not None and threads.value > threads.floor and window["decodes_running/mean"] < threads.value - 1:
            self._change(threads, threads.value - 1, "the loop did not wait and a decode thread was idle")
        elif io is not None and io.value > io.floor and window["reads_in_flight/mean"] < io.value / 4:
            self._change(io, max(io.floor, io.value // 2), "the loop did not wait and reads in flight had room")

    def _io_cap(self, window: dict[str, Any]) -> int:
        """Reads in flight whose bytes fit the memory budget, at the mean object size so far: from
        the figures of this look (``Looks.last``, the stats' running ones), not the live stats,
        so that the rule is decided from the numbers ``look`` was given."""
        figures = self.looks.last or {}
        items = figures.get("read/items", 0)
        mean_bytes = figures.get("read/bytes", 0) / items if items else 0
        return MAX_IO if mean_bytes == 0 else max(1, min(MAX_IO, int(self.memory_budget // mean_bytes)))

    def _change(self, knob: Knob, value: int, why: str) -> None:
        old = knob.value
        if knob.set(value):
            self.changes.append((self.looks.last_time, knob.name, old, knob.value, why))
            self.stats.limits[knob.name] = knob.value


def interval_figures(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Figures for the time between two ``as_dict()`` snapshots: counts and seconds subtract,
    means are recomputed from their time integrals."""
    window = dict(after)
    span = after["active_seconds"] - before["active_seconds"]
    for key, value in after.items():
        if key.endswith("/mean"):
            window[key] = (value * after["active_seconds"] - before[key] * before["active_seconds"]) / span if span > 0 else 0.0
        elif key.endswith(("/items", "/seconds", "/cpu_seconds", "/bytes")) or key in (
            "batches", "samples", "consumer_wait_seconds", "retries", "retry_wait_seconds", "active_seconds", "cpu_seconds",
            "other_processes_cpu_seconds",
        ):
            window[key] = value - before[key]
    return window
