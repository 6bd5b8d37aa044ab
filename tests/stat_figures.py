"""The stats' figures as numbers, for the tests of the adaptive policies (``autotune.py``,
``adapt.py``): one window of running at a time, and the running figures ``LoaderStats.as_dict()``
would give after it, with no loader, thread or clock."""

from __future__ import annotations

from typing import Any

COUNTED = ("active_seconds", "batches", "samples", "consumer_wait_seconds", "cpu_seconds",
           "other_processes_cpu_seconds", "read/seconds", "decode/seconds", "decode/cpu_seconds")


class Stats:
    """The running figures ``LoaderStats.as_dict()`` gives, grown one window of running at a time:
    counts and seconds add up, means are time-weighted, the rest is the window's."""

    def __init__(self, processes: int | None = None) -> None:
        self.figures: dict[str, Any] = {key: 0 for key in COUNTED}
        if processes is not None:
            self.figures["processes"] = processes

    def run(self, window: dict[str, Any]) -> dict[str, Any]:
        before, after = self.figures, dict(self.figures)
        span = window["active_seconds"]
        for key, value in window.items():
            if key in COUNTED:
                after[key] = before[key] + value
            elif key.endswith("/mean"):
                after[key] = (before.get(key, 0.0) * before["active_seconds"] + value * span) / after["active_seconds"]
            else:
                after[key] = value
        self.figures = after
        return after


def window(rate: float = 100.0, waited: float = 0.5, **figures: Any) -> dict[str, Any]:
    """One second of running: ``rate`` samples, the loop waiting ``waited`` of it, decode threads
    taking turns for a GIL on 4 cores unless ``figures`` say otherwise."""
    return {"active_seconds": 1.0, "batches": 10, "samples": rate, "consumer_wait_seconds": waited,
            "cpu_seconds": 1.0, "other_processes_cpu_seconds": 0.0, "read/seconds": 0.0, "decode/seconds": 1.0,
            "decode/cpu_seconds": 0.9, "decodes_running/mean": 1.0, "reads_in_flight/mean": 0.0,
            "batches_ready/mean": 0.2, "producer_waiting/mean": 0.0, "num_threads": 4, "io_concurrency": 64,
            "cpu_cores": 4, "prefetch": 2, "gil/late_ms": 3.0, **figures}
