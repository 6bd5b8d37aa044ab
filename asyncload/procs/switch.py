"""``processes=None``: carries out ``adapt.py``'s decisions for one loader.

It looks at the loader's stats once per ``look_s`` (called at each batch: a clock read
otherwise), starts children in the background when the policy says so, and tells the loader
when to switch pipes: at a batch boundary, once every child has built its pipeline. The loader
then stops its run and goes on with a new one over the same epoch's progress (``loader.py``'s
``_switch``), as a resume would: the plan is the epoch's, only the pipes change, so no sample
is lost, repeated or reordered, and ``state_dict()`` never sees the switch.
"""

from __future__ import annotations

import sys
import time
import warnings
from typing import Any

import torch

from ..adapt import THRESHOLDS, Policy, Step
from ..autotune import _interval_figures
from ..errors import describe
from ..run.pipes import LocalPipes, Pipes
from ..run.settings import Settings
from ..stats.figures import LoaderStats
from ..stats.machine import usable_cores
from .choice import CHILD_BYTES_GUESS, blocked_message, children_blocked, children_memory_allows, children_pss
from .parent import ProcessPool, _guard_advice
from .processes import build_pool

READY_TIMEOUT_S = 120.0  # with wait_for_children: how long the children may take to start


class Switch:
    """The pipes ``processes=None`` runs on now (``pipes``, ``stats``), those starting, and the
    story of the choice (``choice``: one line, shown by ``stats.report()``)."""

    def __init__(self, settings: Settings, local: LocalPipes, device: torch.device | None,
                 thread_limit: int | None, threads: int) -> None:
        self.settings = settings
        self.local = local
        self.local_stats = settings.stats
        self.device = device
        self.thread_limit = thread_limit  # num_threads="auto": the tuner's starting total
        self.threads = threads
        self.thresholds = THRESHOLDS
        self.policy = Policy(usable_cores(), self._memory_allows, self.thresholds)
        self.pipes: Pipes = local
        self.pool: ProcessPool | None = None  # the children in use
        self.starting: ProcessPool | None = None  # children starting in the background
        self.target: tuple[Pipes, LoaderStats, int] | None = None  # what to switch to at the next boundary
        self.per_child = CHILD_BYTES_GUESS
        self.pss: list[tuple[str, int | None]] = []  # the children's memory after each switch, for bench.memory
        self.said: str | None = None  # the one line said when children cannot be used
        self.armed = False  # the policy decided: switch once the children are ready
        self._why = ""
        self.choice = "in this process (measuring: children if the GIL turns out to be the limit)"
        self._show()
        self._last: dict[str, Any] | None = None
        self._last_time = time.perf_counter()

    # ----- looking -----

    def due(self) -> bool:
        """At a batch boundary: True when the loader should switch pipes now (``take``)."""
        if self.starting is not None and (self.armed or not self.thresholds.wait_for_children):
            self._poll_starting()
        if self.policy.state not in ("settled", "starting"):
            now = time.perf_counter()
            if self._last is None or now - self._last_time >= self.thresholds.look_s:
                self._last_time = now
                self._look()
        return self.target is not None and self.armed

    def _look(self) -> None:
        figures = self.settings.stats.as_dict()
        last, self._last = self._last, figures
        if last is None or last.get("processes") != figures.get("processes"):
            return  # a first look, or the stats changed with a switch: the next look has a window
        step = self.policy.look(_interval_figures(last, figures))
        if step is not None:
            self._carry_out(step)

    def _carry_out(self, step: Step) -> None:
        if step.kind == "prepare":
            self._start(step.count, step.why, armed=False)
        elif step.kind == "cancel":
            self._cancel()
        elif step.kind == "start":
            if self.starting is not None and self.starting.count != step.count:
                self._cancel()
            self._why = step.why
            self.armed = True
            if self.starting is None and self.target is None:
                self._start(step.count, step.why)
        elif step.kind == "back":
            self.target, self.armed = (self.local, self.local_stats, 0), True
            self._note(f"in this process: {step.why}", "back in this process")
        elif self.policy.count:
            self._note(f"{self.policy.count} child processes: {self._why}; settled: {step.why}", None)
        else:
            self._note(f"in this process: {step.why}", None)

    def _cancel(self) -> None:
        pool = self.starting or (self.target[0] if self.target is not None else None)
        self.starting = self.target = None
        self.armed = False
        if isinstance(pool, ProcessPool):
            pool.close()

    def _start(self, count: int, why: str, armed: bool = True) -> None:
        arguments = vars(self.settings.pipeline(count, self.thread_limit))
        blocked = children_blocked(arguments)
        if blocked is not None:
            self._cannot(blocked, count)
            return
        try:
            self.starting = build_pool(count, self.settings, self.device, self.thread_limit, self.threads)
        except Exception as error:
            self._cannot(describe(error), count)
            return
        self._why = why
        self.armed = armed
        if armed or not self.thresholds.wait_for_children:
            self._poll_starting()

    def _poll_starting(self) -> None:
        pool = self.starting
        assert pool is not None
        deadline = time.monotonic() + (READY_TIMEOUT_S if self.thresholds.wait_for_children else 0.0)
        try:
            while not pool.ready():
                if time.monotonic() >= deadline:
                    return
                time.sleep(0.01)
        except RuntimeError as error:
            self.starting = None
            pool.close()
            self._cannot(_why_not(error), pool.count)
            return
        self.starting = None
        self.target = (pool, pool.stats, pool.count)  # taken once armed

    def _cannot(self, reason: str, count: int) -> None:
        """Children cannot be used: say so once, in one line, and stay."""
        self.said = blocked_message(reason, count)
        warnings.warn(self.said, RuntimeWarning, stacklevel=2)
        self.policy.failed(reason)
        self._note(f"in this process: child processes cannot be used: {reason}", None)

    # ----- switching -----

    def take(self) -> tuple[Pipes, LoaderStats, int]:
        """The pipes to switch to (the loader stops its run first), their stats and count."""
        assert self.target is not None
        pipes, stats, count = self.target
        self.target = None
        self.armed = False
        old_stats = self.settings.stats
        if stats is self.local_stats:  # going back: a fresh record, as the children's was
            stats = self.local_stats = LoaderStats(**old_stats.limits)
            stats.processes_choice = old_stats.processes_choice
        stats.carry(old_stats)  # the figures stay the loader's lifetime's
        stats.tracer = old_stats.tracer
        self.pipes = pipes
        self.settings.stats = stats
        self._last = None
        if count:
            self.policy.switched(count)
            self._note(f"{count} child processes: {self._why}", f"switch to {count} child processes")
        return pipes, stats, count

    def retire(self) -> None:
        """After the loader's old run has stopped: the pipes no longer used are closed."""
        if self.pool is not None and self.pool is not self.pipes:
            self.pool.close()
        self.pool = self.pipes if isinstance(self.pipes, ProcessPool) else None
        if self.pool is not None:
            self.settings.ring.clear()  # this process's buffers: the children's segments are used now
            pss = children_pss([process.pid for process in self.pool.processes if process.pid is not None])
            self.pss.append((f"{self.pool.count} children", pss))
            if pss:
                self.per_child = max(self.per_child // 2, pss // self.pool.count)

    def _memory_allows(self) -> int:
        return children_memory_allows(self.per_child)

    # ----- the record -----

    def _note(self, choice: str, event: str | None) -> None:
        self.choice = choice
        self._show()
        tracer = self.settings.stats.tracer
        if event is not None and tracer is not None:
            tracer.instant(f"processes: {event}", {"why": choice})

    def _show(self) -> None:
        for stats in {id(s): s for s in (self.settings.stats, self.local_stats)}.values():
            stats.processes_choice = f"processes=None: {self.choice}"

    def close(self) -> None:
        for pool in (self.starting, self.pool):
            if pool is not None:
                pool.close()
        self.starting = None


def _why_not(error: RuntimeError) -> str:
    """One line for children that could not start: the script's missing guard, or the error a
    child sent (without its traceback), or how it died."""
    if str(error) == _guard_advice():
        script = getattr(sys.modules.get("__main__"), "__file__", None) or "the script"
        return (f"{script} has no `if __name__ == \"__main__\":` guard, and spawn imports it again in each child: "
                f"put its top-level code under one")
    return describe(error.__cause__) if error.__cause__ is not None else str(error)
