"""The verdict: what limits the pipeline, named from the figures with its evidence, for
``report()``, the progress bar and the auto-tuner.
"""

from __future__ import annotations

from typing import Any

GIL_LATE_MS = 0.5  # the probe's mean lateness past which the GIL is busy (free: ~0.1 ms)
GIL_HELD_MS = 0.25  # lateness that, with decode threads kept off idle cores, says they queue for the GIL


def _gil_evidence(f: dict[str, Any], cores_used: float, idle_cores: float, late: float, decode_cores: float,
                  turns: bool, queued: float | None) -> str:
    """What says the GIL is the limit, who holds it, and the remedy. ``queued``: the decode threads'
    share of time on a CPU, where only their queueing for the GIL says so."""
    if queued is not None:
        who = (f"the decode threads were on a CPU only {100 * queued:.0f} % of their time in decode: between the "
               f"native calls that release it they queue for it")
    elif turns or decode_cores >= 0.5:
        who = "the decode runs Python code that holds it, so the decode threads take turns"
    else:
        who = (f"the decode threads got only {decode_cores:.2f} cores in decode, so the Python holding it is the "
               f"pipeline's own per sample, or the training step")
    return (f"the process used {cores_used:.2f} of {f['cpu_cores']} cores with {idle_cores:.1f} idle while the loop "
            f"waited, and a thread waking every 5 ms waited {late:.2f} ms on average for the GIL (about 0.1 when "
            f"it is free): Python under one GIL is the limit; {who}. More threads cannot help: processes=N runs the "
            f"pipeline in N processes, each with its own GIL")


def diagnose(f: dict[str, Any]) -> tuple[str, str]:
    """Names what limits the pipeline, from ``LoaderStats.as_dict()`` figures, with the evidence.

    consumer: the user's step (the loop rarely waits: the loader is ahead);
    GIL: cores idle while the loop waits, and a probe thread waits for the GIL (``stats/machine.py``) or
    more than one decode thread is in decode at a time yet together they get about one core: Python
    under one GIL (the pipeline's per sample, a decode that runs Python, the training step) is the
    limit, whatever the threads; ``processes=`` runs the pipeline under N GILs;
    decode CPU: decode threads are busy and use the cores (or share them with other processes);
    storage: reads are in flight at the cap (raise io_concurrency), or reads take far longer
    than decoding while decode threads idle;
    memory: reads and decodes idle while the pipeline sits at its prefetch window: batches of
    buffers are the limit (raise prefetch).
    """
    active = f["active_seconds"]
    if not active or not f["batches"]:
        return "unknown", "no batch delivered yet"
    waited = f["consumer_wait_seconds"] / active
    decode_busy = f["decodes_running/mean"] / f["num_threads"]
    reads = f"reads in flight averaged {f['reads_in_flight/mean']:.1f} of {f['io_concurrency']}"
    cores_used = f["cpu_seconds"] / active
    others = f["other_processes_cpu_seconds"] / active
    if waited < 0.1:
        return "consumer", (f"the loop waited for data {100 * waited:.0f} % of the time; "
                            f"{f['batches_ready/mean']:.1f} batches of {f['prefetch']} were ready on average")
    idle_cores = f["cpu_cores"] - cores_used - others
    decodes = f["decodes_running/mean"]
    decode_cores = f["decode/cpu_seconds"] / active  # the CPU the threads in decode actually got
    on_cpu = decode_cores / decodes if decodes else 1.0  # share of in-decode time on a CPU: < 1 waits on a lock
    late = f.get("gil/late_ms", 0.0)
    # Threads in decode taking turns: together about one core (the GIL's), each off the CPU most of
    # the time. Off the CPU with no CPU at all is a decode that waits GIL-free (a sleep, a GPU).
    turns = decodes >= 1.1 and 0.5 <= decode_cores < 1.25 and on_cpu < 0.85
    # A late probe alone may be the OS's scheduling on a loaded machine: a busy GIL also means the
    # process keeps about a core busy with the Python holding it.
    gil_busy = late >= GIL_LATE_MS and cores_used >= 0.8
    # Native decode with many threads (16 cores, measured): each decode releases the GIL inside
    # its native calls (together they get more than a core) and holds it between them; the
    # threads spend most of their time in decode off the CPU while cores idle, and the probe is
    # late (a decode that waits GIL-free, on I/O or a GPU, leaves it on time and gets no CPU).
    # Each GIL-held stretch is short, so the probe is less late than with pure Python.
    queued = decodes >= 2 and decode_cores >= 1 and on_cpu < 0.6 and idle_cores >= 1 and late >= GIL_HELD_MS
    if f["cpu_cores"] >= 2 and idle_cores > 0.5 and (gil_busy or queued or (f["num_threads"] >= 2 and turns)):
        return "GIL", _gil_evidence(f, cores_used, idle_cores, late, decode_cores, turns,
                                    on_cpu if queued and not gil_busy and not turns else None)
    if decode_busy > 0.75 or (decode_busy > 0.4 and idle_cores < 0.5):
        return "decode CPU", (f"decode threads were busy {100 * decode_busy:.0f} % of the time; the process used "
                              f"{cores_used:.2f} and other processes {others:.2f} of {f['cpu_cores']} cores")
    if f["reads_in_flight/mean"] > 0.75 * f["io_concurrency"]:
        return "storage", f"{reads} (the cap) while decode threads were busy {100 * decode_busy:.0f} % of the time"
    if f["producer_waiting/mean"] > 0.5 and decode_busy < 0.25:
        return "memory", (f"the pipeline sat at its prefetch window {100 * f['producer_waiting/mean']:.0f} % of the "
                          f"time with decode threads busy {100 * decode_busy:.0f} % and {reads}: raise prefetch")
    if f["read/seconds"] > 2 * f["decode/seconds"]:
        return "storage", f"reads took {f['read/seconds']:.1f} s against {f['decode/seconds']:.1f} s of decode; {reads}"
    return "mixed", f"decode threads busy {100 * decode_busy:.0f} %, {reads}, the loop waited {100 * waited:.0f} %"
