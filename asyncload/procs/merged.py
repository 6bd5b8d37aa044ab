"""``loader.stats`` with child processes: the parent's own figures merged with the children's.

The parent counts what happens on its side (batches and samples handed out, the user's waits,
device copies, failures, the time runs were active); each child sends its figures (reads,
decodes, writes, levels, CPU) with every answer. Stage counts and CPU seconds add up; a level's
mean is the sum of the children's time integrals over the parent's active time, so "decodes
running" counts decodes in all processes at once, against the total ``num_threads``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..stats.loader_stats import LoaderStats, StageStats, with_verdict
from ..stats.snapshot import LevelFigures, StatsSnapshot

CHILD_STAGES = ("read", "decode", "write")
CHILD_LEVELS = ("reads_in_flight", "decodes_running")


class ProcessStats(LoaderStats):
    """``as_dict()``, ``report()``, ``failures``, ``on_interval`` work as in-process; ``limits``
    are totals over the processes."""

    def __init__(self, io_concurrency: int, num_threads: int, prefetch: int, processes: int) -> None:
        super().__init__(io_concurrency, num_threads, prefetch)
        self.processes = processes
        self._children: dict[int, StatsSnapshot] = {}  # each child's latest figures
        self._carried: dict[str, StageStats] = {}  # processes=None: what the pipeline did before these children
        self._carried_retries = (0, 0.0)

    def carry(self, earlier: LoaderStats) -> None:
        super().carry(earlier)
        with self._lock:
            self._carried = {name: replace(self.stages[name]) for name in CHILD_STAGES}
            self._carried_retries = (self.retries, self.retry_wait_seconds)

    def update(self, child: int, figures: dict[str, Any]) -> None:
        """Takes a child's latest figures (the user's thread, while it waits for a batch)."""
        snapshot = StatsSnapshot.from_dict(figures)
        with self._lock:
            self._children[child] = snapshot
            children = list(self._children.values())
            for name in CHILD_STAGES:
                stage, carried = self.stages[name], self._carried.get(name, StageStats())
                stage.items = carried.items + sum(getattr(c, name).items for c in children)
                stage.seconds = carried.seconds + sum(getattr(c, name).seconds for c in children)
                stage.bytes = carried.bytes + sum(getattr(c, name).bytes for c in children)
            carried_cpu = self._carried["decode"].cpu_seconds if self._carried else 0.0
            self.stages["decode"].cpu_seconds = carried_cpu + sum(c.decode.cpu_seconds for c in children)
            self.retries = self._carried_retries[0] + sum(c.retries for c in children)
            self.retry_wait_seconds = self._carried_retries[1] + sum(c.retry_wait_seconds for c in children)

    def snapshot(self) -> StatsSnapshot:
        """The parent's figures with the children's levels and CPU added."""
        own = super().snapshot()
        with self._lock:
            children = list(self._children.values())
        active = own.active_seconds
        levels = {}
        for name in CHILD_LEVELS:
            carried = self.levels[name]  # only a carry() sets it: the pipeline runs in the children
            area = carried.area + sum(getattr(c, name).mean * c.active_seconds for c in children)
            peak = max(carried.peak, sum(getattr(c, name).peak for c in children))
            levels[name] = LevelFigures(area / active if active else 0.0, peak)
        children_cpu = sum(c.cpu_seconds for c in children)
        return with_verdict(replace(
            own, **levels, cpu_seconds=own.cpu_seconds + children_cpu, processes=self.processes,
            other_processes_cpu_seconds=max(0.0, own.other_processes_cpu_seconds - children_cpu),
        ))
