"""The machine around the loader: cores this process may use, and CPU the whole machine spent
(through psutil, which reads ``/proc/stat`` on Linux and has its own ways elsewhere), and how busy
the GIL is (``GilProbe``).
"""

from __future__ import annotations

import os
import threading
import time

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


# ----- the GIL probe -----
# How busy the GIL is, measured by a thread that asks for it.
#
# Thread CPU time cannot tell a thread waiting for the GIL from one waiting for a sleep, a GPU or
# a disk: both are off the CPU. So a probe thread sleeps 5 ms at a time and measures how late it
# runs again: waking needs the GIL, and when Python code holds it almost all the time (one core's
# worth of Python in the pipeline, the decoder or the training loop) the probe waits milliseconds
# for its turn, against tens of microseconds when the GIL is free. 200 wake-ups a second cost
# nothing measurable.

PERIOD_S = 0.005


class GilProbe:
    """Sums how late the probe thread woke (``late_seconds``) over ``wakeups`` naps, while started."""

    def __init__(self) -> None:
        self.late_seconds = 0.0
        self.wakeups = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="asyncload-gil-probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            asked = time.perf_counter()
            if self._stop.wait(PERIOD_S):
                return
            late = time.perf_counter() - asked - PERIOD_S
            self.late_seconds += max(0.0, late)
            self.wakeups += 1

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()  # it only waits on ``_stop``: it ends at once, however loaded the machine
            self._thread = None

    def mean_late_ms(self) -> float:
        return 1000 * self.late_seconds / self.wakeups if self.wakeups else 0.0
