"""A training step that is CPU-bound in Python: it holds the GIL for its whole length, as a
Python-heavy model, a data-parallel wrapper or per-step logging do.

The amount of work is fixed in loop iterations, calibrated once per benchmark run on the idle
machine, so every contender's consumer does exactly the same work; what varies is how much the
loader slows it down (and how much it slows the loader).
"""

from __future__ import annotations

import statistics
import time


def python_step(loops: int) -> int:
    """Pure-Python arithmetic: no C call long enough to release the GIL."""
    total = 0
    for i in range(loops):
        total += i * i % 7
    return total


def calibrate(seconds: float, tries: int = 5, probe: int = 100_000) -> int:
    """Loop iterations that take ``seconds`` on this machine now (fastest of ``tries``)."""
    best = float("inf")
    for _ in range(tries):
        started = time.perf_counter()
        python_step(probe)
        best = min(best, time.perf_counter() - started)
    return max(1, round(seconds * probe / best))


def time_alone(loops: int, tries: int = 5) -> float:
    """Median seconds of one step with nothing else running in the process."""
    times = []
    for _ in range(tries):
        started = time.perf_counter()
        python_step(loops)
        times.append(time.perf_counter() - started)
    return statistics.median(times)
