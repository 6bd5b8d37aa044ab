"""``processes=None``: carries out ``adapt.py``'s decisions for one loader.

It looks at the loader's stats once per ``look_s`` (called at each batch: a clock read
otherwise), starts children in the background when the policy says so (a new backend from
``build_backend``, built on a thread: ``Starting``), does not judge the looks while they start
(they take the idle cores the verdict counts), and tells the pass when to switch: at a batch
boundary, once every child has built its pipeline. The pass (``epoch/passes.py``) then drains its driver, stops it and goes
on with a new one on the new backend over the same epoch's ledger, as a resume would: the plan
is the epoch's, only the backend changes, so no sample is lost, repeated or reordered, and
``state_dict()`` never sees the switch. Going back to this process builds a fresh in-process
backend; nothing built is ever changed into something else.
"""

from __future__ import annotations

import sys
import threading
import time
import warnings
from typing import Callable

from .adapt import THRESHOLDS, Policy, Step
from .autotune import Looks
from .backend import build_backend
from .batch.crossing import unportable
from .errors import describe
from .pipeline.batched import image_placement, is_batched
from .pipeline.pipelines import Backend
from .procs.choice import CHILD_BYTES_GUESS, blocked_message, children_blocked, children_memory_allows, children_pss
from .procs.script import guard_advice, refuse_while_bootstrapping
from .procs.parent import ProcessPool
from .settings import LoaderSettings
from .stats.machine import usable_cores

READY_TIMEOUT_S = 120.0  # with wait_for_children: how long the children may take to start


def adaptive_switch(settings: LoaderSettings, backend: Backend, use: Callable[[Backend], None]) -> Switch | None:
    """The loader's ``Switch`` where it may move: ``processes=None`` (or ``"auto"``) without
    ``isolate``, with a decoder of samples (one of whole batches stays where it is)."""
    if not settings.adaptive or is_batched(settings.decode):
        return None
    refuse_while_bootstrapping(say=False)  # a child importing an unguarded script: the parent says why
    return Switch(settings, backend, use)


class Switch:
    """The backend ``processes=None`` runs on now (``backend``), the one starting, and the story
    of the choice (``choice``: one line, shown by ``stats.report()``). ``use``: the loader's, called
    with each backend switched to (its stats and tuner become the loader's)."""

    def __init__(self, settings: LoaderSettings, backend: Backend, use: Callable[[Backend], None],
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.settings = settings
        self.clock = clock  # seconds, for the looks; a test's own, to drive ``due`` without waiting
        self.backend = backend
        self.use = use
        self.thresholds = THRESHOLDS
        self.policy = Policy(usable_cores(), self._memory_allows, self.thresholds)
        self.starting: Starting | None = None  # children starting in the background
        self.target: Backend | None = None  # what to switch to at the next boundary
        self.retired: Backend | None = None  # switched from: closed once its run stopped
        self.per_child = CHILD_BYTES_GUESS
        self.pss: list[tuple[str, int | None]] = []  # the children's memory after each switch, for bench.memory
        self.said: str | None = None  # the one line said when children cannot be used
        self.armed = False  # the policy decided: switch once the children are ready
        self._why = ""
        self.choice = "in this process (measuring: children if the GIL turns out to be the limit)"
        self._show()
        self.looks = Looks(self.thresholds.look_s, clock(), at_once=True)

    # ----- looking -----

    def due(self) -> bool:
        """At a batch boundary: True when the pass should switch backends now (``take``)."""
        if self.starting is not None and (self.armed or not self.thresholds.wait_for_children):
            self._poll_starting()
        if self.policy.state not in ("settled", "starting"):
            now = self.clock()
            if self.looks.due(now):
                self._look(now)
        return self.target is not None and self.armed

    def _look(self, now: float) -> None:
        window = self.looks.take(self.backend.stats.as_dict(), now)  # None: a first look, or a switch's
        if window is None or self.starting is not None:
            return  # children starting take the idle cores: the window says nothing of the loader
        step = self.policy.look(window)
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
            self.target, self.armed = self._build(0), True
            self._note(f"in this process: {step.why}", "back in this process")
        elif self.policy.count:
            self._note(f"{self.policy.count} child processes: {self._why}; settled: {step.why}", None)
        else:
            self._note(f"in this process: {step.why}", None)

    def _cancel(self) -> None:
        starting, target = self.starting, self.target
        self.starting = self.target = None
        self.armed = False
        if starting is not None:
            starting.cancel()
        if target is not None:
            target.close()

    def _build(self, count: int) -> Backend:
        """A new backend of ``count`` children (0: this process), recording into the loader's
        tracer, its ring laid out as the one in use when the layout was learnt here."""
        backend = build_backend(self.settings, count, device_stage=self.backend.device_stage,
                                tracer=self.backend.stats.tracer)
        layout = self.backend.ring.layout
        if backend.ring.layout is None and layout is not None:
            if count:
                backend.ring.configure(layout, self.settings.batch_size)
            else:
                backend.ring.configure(layout, self.settings.batch_size,
                                       image_placement(self.settings.decode, self.settings.device, 0))
        return backend

    def _start(self, count: int, why: str, armed: bool = True) -> None:
        ring = self.backend.ring  # in this process: values its samples put aside must be able to travel
        aside = ring.aside_values() if hasattr(ring, "aside_values") else []  # from children: they did
        blocked = (children_blocked(self.settings.for_children())
                   or unportable(ring.layout, aside))
        if blocked is not None:
            self._cannot(blocked, count)
            return
        self.starting = Starting(count, lambda: self._build(count))
        self._why = why
        self.armed = armed
        if armed or not self.thresholds.wait_for_children:
            self._poll_starting()

    def _poll_starting(self) -> None:
        starting = self.starting
        assert starting is not None
        wait = READY_TIMEOUT_S if self.thresholds.wait_for_children else 0.0
        deadline = time.monotonic() + wait
        starting.thread.join(wait)
        if starting.thread.is_alive():
            return
        backend = starting.backend
        if backend is None:  # the build raised
            self.starting = None
            self._cannot(describe(starting.error), starting.count)
            return
        assert isinstance(backend.pipelines, ProcessPool)
        try:
            while not backend.pipelines.ready():
                if time.monotonic() >= deadline:
                    return
                time.sleep(0.01)
        except RuntimeError as error:
            self.starting = None
            backend.close()
            self._cannot(_why_not(error), backend.processes)
            return
        self.starting = None
        self.target = backend  # taken once armed
        # The looks while they started saw their start's CPU, not the loader's: not judged
        # (``_look``); the next window starts now.
        self.looks.take(self.backend.stats.as_dict(), self.clock())

    def _cannot(self, reason: str, count: int) -> None:
        """Children cannot be used: say so once, in one line, and stay."""
        self.said = blocked_message(reason, count)
        warnings.warn(self.said, RuntimeWarning, stacklevel=2)
        self.policy.failed(reason)
        self._note(f"in this process: child processes cannot be used: {reason}", None)

    # ----- switching -----

    def take(self) -> Backend:
        """The backend to switch to, once the pass stopped its driver on the old one: its stats
        go on from the old one's (``carry``), and it becomes the loader's (``use``)."""
        backend, old = self.target, self.backend
        assert backend is not None
        self.target = None
        self.armed = False
        backend.stats.carry(old.stats)  # the figures stay the loader's lifetime's
        backend.stats.processes_choice = old.stats.processes_choice
        self.backend, self.retired = backend, old
        self.looks.forget()
        count = backend.processes
        if count:
            self.policy.switched(count)
            self._note(f"{count} child processes: {self._why}", f"switch to {count} child processes")
        self.use(backend)
        return backend

    def retire(self) -> None:
        """After the old backend's run has stopped: it is closed, and the children's memory noted."""
        if self.retired is not None:
            self.retired.close()
            self.retired = None
        pool = self.backend.pipelines
        if isinstance(pool, ProcessPool):
            pss = children_pss([process.pid for process in pool.processes if process.pid is not None])
            self.pss.append((f"{pool.count} children", pss))
            if pss:
                self.per_child = max(self.per_child // 2, pss // pool.count)

    def _memory_allows(self) -> int:
        return children_memory_allows(self.per_child)

    # ----- the record -----

    def _note(self, choice: str, event: str | None) -> None:
        self.choice = choice
        self._show()
        tracer = self.backend.stats.tracer
        if event is not None and tracer is not None:
            tracer.instant(f"processes: {event}", {"why": choice})

    def _show(self) -> None:
        self.backend.stats.processes_choice = f"processes=None: {self.choice}"

    def close(self) -> None:
        """The backends not in use (the loader closes its own): children still starting, or
        ready and not switched to."""
        if self.starting is not None:
            self.starting.cancel(wait=True)
        for backend in (self.target, self.retired):
            if backend is not None:
                backend.close()
        self.starting = self.target = self.retired = None


class Starting:
    """A backend of ``count`` children built on a thread of its own (``build``): starting a
    child from the fork server waits until the server has imported torch and the pipeline (a
    second or two, once per process), and the batches must go on meanwhile. ``cancel()``: the
    backend is closed as soon as it exists."""

    def __init__(self, count: int, build: Callable[[], Backend]) -> None:
        self.count = count
        self.backend: Backend | None = None
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._cancelled = False
        self.thread = threading.Thread(target=self._run, args=(build,), name="asyncload-start", daemon=True)
        self.thread.start()

    def _run(self, build: Callable[[], Backend]) -> None:
        try:
            backend = build()
        except BaseException as error:
            self.error = error
            return
        with self._lock:
            self.backend = backend
            cancelled = self._cancelled
        if cancelled:
            backend.close()

    def cancel(self, wait: bool = False) -> None:
        """The backend is not wanted: closed now if built, else as soon as it is. ``wait``: also
        wait (``READY_TIMEOUT_S`` at most) for the build to end, so no child outlives the caller."""
        with self._lock:
            self._cancelled = True
            backend = self.backend
        if backend is not None:
            backend.close()
        elif wait:
            self.thread.join(READY_TIMEOUT_S)


def _why_not(error: RuntimeError) -> str:
    """One line for children that could not start: the script's missing guard, or the error a
    child sent (without its traceback), or how it died."""
    if str(error) == guard_advice():
        script = getattr(sys.modules.get("__main__"), "__file__", None) or "the script"
        return (f"{script} has no `if __name__ == \"__main__\":` guard, and each child imports it again: "
                f"put its top-level code under one")
    return describe(error.__cause__) if error.__cause__ is not None else str(error)
