"""``loader.stats.report()``'s text: a table of the stages, what was in flight, the consumer's
figures, the bottleneck with its evidence (``verdict.py``) and where the pipeline runs."""

from __future__ import annotations

from .snapshot import STAGES, StatsSnapshot
from .verdict import diagnose


def report_text(s: StatsSnapshot, processes_choice: str | None, gpu_decode_choice: str | None = None,
                decoded_on_cpu_why: dict[str, int] | None = None) -> str:
    """The report of snapshot ``s``; ``processes_choice``: the default's line, if it has one;
    ``gpu_decode_choice``: the GPU decode stage's split and why, if it ran; ``decoded_on_cpu_why``:
    the samples it left to the CPU path, by reason."""
    active = max(s.active_seconds, 1e-9)
    lines = [f"{'stage':<8}{'items':>9}{'busy s':>9}{'ms/item':>9}{'MB':>9}"]
    for name in STAGES:
        stage = getattr(s, name)
        if stage.items:
            lines.append(f"{name:<8}{stage.items:>9}{stage.seconds:>9.2f}{1000 * stage.seconds / stage.items:>9.2f}"
                         f"{stage.bytes / 1e6:>9.1f}")
    reads, decodes, ready = s.reads_in_flight, s.decodes_running, s.batches_ready
    lines.append(
        f"in flight (mean/peak/limit): reads {reads.mean:.1f}/{reads.peak}/{s.io_concurrency}, "
        f"decodes {decodes.mean:.1f}/{decodes.peak}/{s.num_threads}, "
        f"batches ready {ready.mean:.1f}/{ready.peak}/{s.prefetch}"
    )
    lines.append(
        f"consumer: {s.batches} batches, {s.samples} samples in {active:.2f} s "
        f"({s.samples / active:.0f}/s), waited {100 * s.consumer_wait_seconds / active:.0f} % of the time; "
        f"CPU {s.cpu_seconds / active:.2f} cores; retries {s.retries} ({s.retry_wait_seconds:.1f} s waiting), failures {s.failures}"
    )
    if gpu_decode_choice is not None:
        lines.append(gpu_decode_choice)
    if s.decoded_on_cpu:
        why = "".join(f"; {reason}: {count}" for reason, count in sorted((decoded_on_cpu_why or {}).items()))
        lines.append(f"GPU decoder: {s.decoded_on_cpu} of {s.decode.items} samples took its CPU path{why}")
    name, evidence = diagnose(s.as_dict())
    lines.append(f"bottleneck: {name}: {evidence}")
    if processes_choice is not None:
        lines.append(processes_choice)
    return "\n".join(lines)
