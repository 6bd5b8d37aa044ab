"""The machine around the loader: cores this process may use, and CPU the whole machine spent
(through psutil, which reads ``/proc/stat`` on Linux and has its own ways elsewhere).
"""

from __future__ import annotations

import os

import psutil


def system_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent busy, or 0 where unknown: tells contention by
    other processes from threads waiting on the GIL."""
    try:
        times = psutil.cpu_times()
    except (OSError, RuntimeError):
        return 0.0
    busy = ("user", "nice", "system", "irq", "softirq", "steal")  # idle and iowait are not busy
    return float(sum(getattr(times, name, 0.0) for name in busy))


def usable_cores() -> int:
    """The cores this process may run on (its affinity), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
