"""How many rows of each batch the GPU decodes while the CPU decode threads take the rest.

The batch is complete when its slower half is: with the GPU decoding ``g`` rows/s and the CPU
threads ``c`` rows/s together, both finish at once when the GPU takes ``g / (g + c)`` of the rows.
That is the split while the loader is what the training step waits for. When the step is the
slower one (the loader sees its time between ``next()`` calls), there is no point decoding faster
than it consumes, and GPU decode only takes from the step (the CUDA decode uses SMs; the hardware
engines do not, but their copies and resize do): the GPU then takes only what the CPU cannot
decode in one step's time. A slower step (GPU decode slowing it included) so shrinks the GPU's
share, down to none when the CPU keeps up alone.

The rates are smoothed (exponential means of rows/s per call), from the calls of both kinds the
stage makes; until both are known the split is half and half. The GPU's first call is not
counted: it pays the warm-up (cold nvJPEG, CUDA modules loaded lazily), and a rate that low
would round its share to nothing. A side given no rows is never measured again, so a stale rate
would starve it for good: every ``PROBE_EVERY``-th batch each side gets at least a probe
(1/``PROBE_FRACTION`` of the batch, at least one row on the GPU and ``cpu_chunk`` on the CPU)
and so stays measured. A pure class: fed events, no clock, no thread, so its tests drive it
directly (its one lock only keeps the row counts whole when a decode thread moves rows).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

SMOOTHING = 0.3  # the weight of the newest measurement in each exponential mean
PROBE_EVERY = 10  # every this many batches each side gets at least a probe share, to stay measured
PROBE_FRACTION = 16  # a probe share is at least 1/this of the batch (a few rows: one alone would measure mostly the per-call cost)
HEADROOM = 0.8  # under a slower step, the CPU is counted for this share of what it decoded: room for jitter


@dataclass
class Rate:
    """An exponential mean of rows per second (None until the first measurement)."""

    value: float | None = None

    def add(self, rows: int, seconds: float) -> None:
        if rows <= 0 or seconds <= 0:
            return
        rate = rows / seconds
        self.value = rate if self.value is None else (1 - SMOOTHING) * self.value + SMOOTHING * rate


class SplitPolicy:
    """The GPU's share of each batch: ``gpu_rows(batch_rows)``; fed ``gpu_done`` / ``cpu_done``
    (rows decoded and the wall seconds one call took) and ``step`` (the training step's seconds
    between batches). ``mode``: ``"auto"`` (measured, the default), ``"gpu"`` (every row; per-sample
    fallbacks still go to the CPU) or ``"cpu"`` (none). ``cpu_threads``: the decode threads the CPU
    share is spread over (one CPU call's rate times these is the CPU's rate); ``cpu_chunk``: the
    fewest rows the loader gives one CPU call (the CPU's probe share is at least this)."""

    def __init__(self, mode: str = "auto", cpu_threads: int = 1, cpu_chunk: int = 1) -> None:
        if mode not in ("auto", "gpu", "cpu"):
            raise ValueError(f"mode must be 'auto', 'gpu' or 'cpu', got {mode!r}")
        self.mode = mode
        self.cpu_threads = max(1, cpu_threads)
        self.cpu_chunk = max(1, cpu_chunk)
        self.gpu_calls = 0  # the GPU calls heard of; the first (warm-up) is not measured
        self.batches = 0  # the batches cut in "auto" with both rates known; every PROBE_EVERY-th probes
        self.gpu = Rate()
        self.cpu = Rate()  # of one thread
        self.step_s = Rate()  # batches per second of the step, stored as a rate of 1 batch
        self.rows = {"gpu": 0, "cpu": 0}  # rows given to each side so far
        self._count_lock = threading.Lock()  # rows: the cut (event loop) and moved_to_cpu (a decode thread)
        self.why = "half and half until both rates are measured" if mode == "auto" else f"pinned: {mode} only"

    def __getstate__(self) -> dict:  # a copy (a pickled decoder) gets a lock of its own
        state = dict(self.__dict__)
        del state["_count_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._count_lock = threading.Lock()

    # ----- events -----

    def gpu_done(self, rows: int, seconds: float) -> None:
        """A GPU call given rows decoded ``rows`` of them in ``seconds`` (the others fell back to
        the CPU). None decoded is a rate of 0, not no measurement: else a GPU that decodes nothing
        (nvImageCodec without its nvJPEG extension) kept half of every batch for ever, all of it
        decoded by the CPU path on the GPU job's one thread."""
        self.gpu_calls += 1
        if self.gpu_calls <= 1:  # the first call's time is the warm-up's
            return
        if rows == 0 and seconds > 0:
            self.gpu.value = 0.0 if self.gpu.value is None else (1 - SMOOTHING) * self.gpu.value
        else:
            self.gpu.add(rows, seconds)

    def cpu_done(self, rows: int, seconds: float) -> None:
        self.cpu.add(rows, seconds)

    def cpu_only(self, rows: int) -> None:
        """``rows`` of a batch only the CPU decodes (their headers say the GPU would refuse them),
        given to the CPU besides ``gpu_rows``' share: counted in ``describe``."""
        with self._count_lock:
            self.rows["cpu"] += rows

    def moved_to_cpu(self, rows: int) -> None:
        """``rows`` of the GPU's share went to the CPU after all (local files whose headers,
        read in the GPU job, say the GPU would refuse them): counted on the CPU's side."""
        with self._count_lock:
            self.rows["gpu"] -= rows
            self.rows["cpu"] += rows

    def step(self, seconds: float) -> None:
        """The training step took ``seconds`` between two batches (the loader's wait excluded)."""
        self.step_s.add(1, seconds)

    # ----- the decision -----

    def gpu_rows(self, batch_rows: int) -> int:
        """How many of ``batch_rows`` the GPU decodes, the rest going to the CPU threads."""
        count = self._choose(batch_rows)
        with self._count_lock:
            self.rows["gpu"] += count
            self.rows["cpu"] += batch_rows - count
        return count

    def _choose(self, batch_rows: int) -> int:
        if self.mode == "gpu":
            return batch_rows
        if self.mode == "cpu":
            return 0
        if self.gpu.value is None or self.cpu.value is None:
            self.why = "half and half until both rates are measured"
            return (batch_rows + 1) // 2
        self.batches += 1
        count = self._measured(batch_rows)
        if self.batches % PROBE_EVERY == 0:
            probed = self._probed(count, batch_rows)
            if probed != count:
                self.why += f"; a probe share (every {PROBE_EVERY}th batch) keeps both rates measured"
            return probed
        return count

    def _probed(self, count: int, batch_rows: int) -> int:
        """``count`` moved so that each side gets at least its probe share (where the batch has
        rows for both)."""
        if batch_rows < 2:
            return count
        gpu = min(max(1, batch_rows // PROBE_FRACTION), batch_rows - 1)
        cpu = min(max(self.cpu_chunk, batch_rows // PROBE_FRACTION), batch_rows - gpu)
        return min(max(count, gpu), batch_rows - cpu)

    def _measured(self, batch_rows: int) -> int:
        assert self.gpu.value is not None and self.cpu.value is not None
        gpu, cpu = self.gpu.value, self.cpu.value * self.cpu_threads
        balanced = round(batch_rows * gpu / (gpu + cpu))
        rates = f"GPU {gpu:,.0f} rows/s, CPU {cpu:,.0f} rows/s ({self.cpu_threads} threads)"
        if self.step_s.value is not None:
            step = 1 / self.step_s.value
            cpu_alone = cpu * step * HEADROOM  # what the CPU decodes while one step runs
            needed = max(0, batch_rows - int(cpu_alone))
            if needed < balanced:
                self.why = (f"{rates}; the step ({1000 * step:.0f} ms) is slower than the balanced batch: "
                            f"the GPU takes only what the CPU cannot decode in one step")
                return needed
        self.why = f"{rates}: both finish a batch at once"
        return max(0, min(batch_rows, balanced))

    def describe(self) -> str:
        """One line for ``stats.report()``: the share each side decoded and why."""
        total = self.rows["gpu"] + self.rows["cpu"]
        share = 100 * self.rows["gpu"] / total if total else 0.0
        return f"GPU decode ({self.mode}): GPU {share:.0f} % of {total} rows, CPU the rest; {self.why}"
