"""``loader.stats`` with child processes: the parent's own figures merged with the children's.

The parent counts what happens on its side (batches and samples handed out, the user's waits,
device copies, failures, the time runs were active); each child sends its figures (reads,
decodes, writes, levels, CPU) with every answer. Stage counts and CPU seconds add up; a level's
mean is the sum of the children's time integrals over the parent's active time, so "decodes
running" counts decodes in all processes at once, against the total ``num_threads``.
"""

from __future__ import annotations

from typing import Any

from ..stats.figures import LoaderStats, diagnose

CHILD_STAGES = ("read", "decode", "write")
CHILD_LEVELS = ("reads_in_flight", "decodes_running")


class ProcessStats(LoaderStats):
    """``as_dict()``, ``report()``, ``failures``, ``on_interval`` work as in-process; ``limits``
    are totals over the processes."""

    def __init__(self, io_concurrency: int, num_threads: int, prefetch: int, processes: int) -> None:
        super().__init__(io_concurrency, num_threads, prefetch)
        self.processes = processes
        self._children: dict[int, dict[str, Any]] = {}

    def update(self, child: int, figures: dict[str, Any]) -> None:
        """Takes a child's latest figures (the user's thread, while it waits for a batch)."""
        with self._lock:
            self._children[child] = figures
            for name in CHILD_STAGES:
                stage = self.stages[name]
                stage.items = sum(f[f"{name}/items"] for f in self._children.values())
                stage.seconds = sum(f[f"{name}/seconds"] for f in self._children.values())
                stage.bytes = sum(f[f"{name}/bytes"] for f in self._children.values())
            self.stages["decode"].cpu_seconds = sum(f["decode/cpu_seconds"] for f in self._children.values())
            self.retries = sum(f["retries"] for f in self._children.values())

    def as_dict(self) -> dict[str, Any]:
        figures = super().as_dict()
        with self._lock:
            children = list(self._children.values())
        active = figures["active_seconds"]
        for name in CHILD_LEVELS:
            area = sum(f[f"{name}/mean"] * f["active_seconds"] for f in children)
            figures[f"{name}/mean"] = area / active if active else 0.0
            figures[f"{name}/peak"] = sum(f[f"{name}/peak"] for f in children)
        children_cpu = sum(f["cpu_seconds"] for f in children)
        figures["cpu_seconds"] += children_cpu
        figures["other_processes_cpu_seconds"] = max(0.0, figures["other_processes_cpu_seconds"] - children_cpu)
        figures["processes"] = self.processes
        figures["bottleneck"] = diagnose(figures)[0]
        return figures
