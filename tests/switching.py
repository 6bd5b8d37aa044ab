"""A ``processes=None`` loader made to switch to two children at a known batch, whatever the
machine: the policy's judge is told the GIL is the limit, looks come at every batch, and the
switch waits for the children to start. The switch's mechanics are then tested without timing."""

from __future__ import annotations

import dataclasses

import asyncload.adapt as adapt
import asyncload.switch as switch


def force_switch(monkeypatch, children: int = 2) -> None:
    """Loaders built from now on (in the test) switch to ``children`` children after the second
    batch handed out (the first look sets the baseline, the second decides) and stay there."""
    forced = dataclasses.replace(adapt.THRESHOLDS, look_s=0.0, looks=1, first=children, most=children, keep=0.0,
                                 wait_for_children=True)
    monkeypatch.setattr(adapt, "THRESHOLDS", forced)
    monkeypatch.setattr(switch, "THRESHOLDS", forced)
    monkeypatch.setattr(adapt, "gil_bound", lambda window: (True, "GIL: forced by the test"))


def children_of(loader) -> int:
    """How many children the loader runs on now (0: in this process)."""
    return loader._backend.processes
