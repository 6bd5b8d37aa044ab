"""A ``processes=None`` loader made to switch to two children at a known batch, whatever the
machine: the policy's judge is told the GIL is the limit, looks come at every batch, and the
switch waits for the children to start. The switch's mechanics are then tested without timing."""

from __future__ import annotations

import dataclasses
import threading
import time

import asyncload.adapt as adapt
import asyncload.switch as switch


def set_thresholds(monkeypatch, **changes) -> None:
    """The policy's thresholds with ``changes``, for loaders built from now on in the test (both
    modules hold them)."""
    changed = dataclasses.replace(adapt.THRESHOLDS, **changes)
    monkeypatch.setattr(adapt, "THRESHOLDS", changed)
    monkeypatch.setattr(switch, "THRESHOLDS", changed)


def force_switch(monkeypatch, children: int = 2) -> None:
    """Loaders built from now on (in the test) switch to ``children`` children after the second
    batch handed out (the first look sets the baseline, the second decides) and stay there."""
    set_thresholds(monkeypatch, look_s=0.0, looks=1, first=children, most=children, keep=0.0, wait_for_children=True)
    monkeypatch.setattr(adapt, "gil_bound", lambda window: (True, "GIL: forced by the test"))


def slow_builds(monkeypatch, pids: list[int] | None = None, seconds: float = 0.5,
                until: threading.Event | None = None) -> None:
    """Children's backends take ``seconds`` more to build (the fork server is warm after other
    tests: a start that lasts), or with ``until``, until the test sets it (a minute at most: no
    hang); their pids go to ``pids``."""
    real = switch.build_backend

    def slow_build(*args, **kwargs):
        if until is not None:
            until.wait(60)
        else:
            time.sleep(seconds)
        backend = real(*args, **kwargs)
        if pids is not None:
            pids.extend(process.pid for process in backend.pipelines.processes)
        return backend

    monkeypatch.setattr(switch, "build_backend", slow_build)


def children_of(loader) -> int:
    """How many children the loader runs on now (0: in this process)."""
    return loader._backend.processes
