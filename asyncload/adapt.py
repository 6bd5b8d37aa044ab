"""``processes=None``'s policy: when to move reads and decode into child processes, and how many.

The loader starts in its own process. Every ``look_s`` of running it looks at what its stats
saw since the last look (the verdict ``loader.stats.report()`` names, ``stats/verdict.py``).
When ``looks`` looks in a row say Python under one GIL is the limit with cores idle, it starts
children (in the background: the loop goes on meanwhile) and switches to them at a batch
boundary once they are ready. It then compares samples/s: a first step that did not help goes
back to this process; one that helped by ``gain`` is followed by a step with more children
(twice as many, up to the cores and what memory allows); otherwise it settles. Settled, it
never moves again: a noisy minute cannot flip it back and forth. Native decode that is not
GIL-bound never gets a GIL verdict, so it stays here.

This module decides only (from figures, no clock, no process), so that it is tested without
timing; ``switch.py`` carries the decisions out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .stats.verdict import diagnose


@dataclass
class Thresholds:
    """What the policy waits for; tests shorten them (``THRESHOLDS``)."""

    look_s: float = 0.3  # seconds between looks
    looks: int = 2  # GIL verdicts in a row before children are started (one noisy look is not enough)
    gain: float = 1.15  # samples/s a step must add (as a ratio) for the next step
    keep: float = 1.0  # a first step below this ratio to in-process goes back to this process
    first: int | None = None  # children of the first step; None: max(2, cores // 4)
    most: int | None = None  # children at most; None: the usable cores
    wait_for_children: bool = False  # True: the switch waits for the children to start (tests: a fixed batch)


THRESHOLDS = Thresholds()
CANCEL_LOOKS = 8  # looks in a row without a GIL verdict before children started ahead are stopped
MOST_PREPARES = 2  # children started ahead of a decision, at most this many times per loader


def gil_bound(window: dict[str, Any]) -> tuple[bool, str]:
    """Whether the window's verdict is the GIL (which needs idle cores), and its evidence."""
    name, evidence = diagnose(window)
    return name == "GIL", f"{name}: {evidence}"


@dataclass
class Step:
    """What the loader does next: ``prepare`` ``count`` children (start them, not switch yet),
    ``cancel`` those, ``start`` them (switching once they are ready), go ``back`` to this
    process, or ``settle`` where it is. ``why``: for the report."""

    kind: str
    count: int
    why: str


class Policy:
    """The decisions of one loader, from one look's figures at a time (``look``)."""

    def __init__(self, cores: int, memory_allows: Callable[[], int], thresholds: Thresholds | None = None,
                 judge: Callable[[dict[str, Any]], tuple[bool, str]] | None = None) -> None:
        self.t = thresholds or THRESHOLDS
        self.cores = cores
        self.memory_allows = memory_allows  # children memory has room for now
        self.judge = judge or gil_bound
        self.state = "measuring"  # -> starting -> trying -> (starting ...) settled
        self.count = 0  # children in use
        self.streak: list[float] = []  # samples/s of the GIL-bound looks in a row
        self.rates = {0: 0.0}  # samples/s measured with each count of children
        self._warming = False  # the first look after a switch is the ramp: not measured
        self.preparing = False  # children started ahead of the decision (``prepare``)
        self.prepares = 0  # how many times: starting children costs CPU, so it is rationed
        self.calm = 0  # looks in a row that did not say GIL

    def most(self) -> int:
        return max(1, self.t.most if self.t.most is not None else self.cores)

    def look(self, window: dict[str, Any]) -> Step | None:
        """One look's figures (``LoaderStats.as_dict()`` over the look); the step to take, if any."""
        if self.state in ("starting", "settled") or not window["active_seconds"] or not window["batches"]:
            return None
        rate = window["samples"] / window["active_seconds"]
        if self.state == "measuring":
            return self._measure(window, rate)
        if self._warming:
            self._warming = False
            return None
        return self._judge_step(window, rate)

    def _measure(self, window: dict[str, Any], rate: float) -> Step | None:
        bound, evidence = self.judge(window)
        if not bound:
            self.streak = []
            self.calm += 1
            if self.preparing and self.calm >= CANCEL_LOOKS:  # the children were started for nothing
                self.preparing = False
                return Step("cancel", 0, evidence)
            return None
        self.calm = 0
        self.streak.append(rate)
        first = min(self.t.first if self.t.first is not None else max(2, self.cores // 4), self.most())
        if len(self.streak) < self.t.looks:
            if self.preparing or self.prepares >= MOST_PREPARES:
                return None
            self.prepares += 1
            # Children take a second or more to start: they start now, in case the next looks
            # agree; the switch itself still waits for ``looks`` verdicts in a row.
            step = self._step_to(first, evidence, "prepare")
            self.preparing = step.kind == "prepare"
            return step
        self.rates[0] = sorted(self.streak)[len(self.streak) // 2]
        return self._step_to(first, f"{evidence} ({self.rates[0]:.0f} samples/s in this process)")

    def _step_to(self, count: int, why: str, kind: str = "start") -> Step:
        allowed = self.memory_allows()
        if allowed < count:
            if allowed <= self.count or allowed < 2 and self.count == 0:
                return self._settle(f"memory has room for {allowed} child processes only; {why}")
            count = allowed
        if kind == "start":
            self.state = "starting"
            self.preparing = False
        return Step(kind, count, why)

    def _judge_step(self, window: dict[str, Any], rate: float) -> Step | None:
        previous = max((c for c in self.rates if c < self.count), default=0)
        before = self.rates[previous]
        self.rates[self.count] = rate
        ratio = rate / before if before else float("inf")
        said = f"{self.count} processes gave {rate:.0f} samples/s, {ratio:.2f}x {previous or 'in-process'}'s"
        if previous == 0 and ratio < self.t.keep:
            self.state = "settled"
            return Step("back", 0, f"{said}: back in this process")
        waiting = diagnose(window)[0] != "consumer"
        grow = min(self.most(), 2 * self.count)
        if ratio >= self.t.gain and waiting and grow > self.count:
            return self._step_to(grow, f"{said}: trying more")
        return self._settle(said + ("" if waiting else ": the loader is ahead of the loop"))

    def _settle(self, why: str) -> Step:
        self.state = "settled"
        return Step("settle", self.count, why)

    def switched(self, count: int) -> None:
        """The loader now runs on ``count`` children: the next looks measure them."""
        self.count = count
        self.state = "trying"
        self._warming = True

    def failed(self, why: str) -> Step:
        """Children could not be started or used: stay as it is, for good."""
        return self._settle(why)
