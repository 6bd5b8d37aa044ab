"""Runs decodes in a child process under an address-space limit (RLIMIT_AS) a few GB over its
steady state, so that a decode that would take gigabytes fails there (MemoryError, a native
allocation error) instead of putting the test machine at risk. Used as
``python -m tests.bounded EXTRA_BYTES CASES_MODULE:FUNCTION`` by ``run_bounded``."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def address_space() -> int:
    """This process's mapped address space (VmSize), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def run_bounded(extra_bytes: int, cases: str, threads: int = 2, timeout: float = 120) -> dict[str, str]:
    """Runs ``cases`` (``module:function`` returning {name: callable}) in a child limited to its
    steady state plus ``extra_bytes``, ``threads`` cases at a time; returns name -> "ok" or the
    exception's ``Type: message``, and ``peak_rss_growth_mb``: how far the peak resident size
    grew past the steady state's (a lower bound of what the cases took at once)."""
    command = [sys.executable, "-m", "tests.bounded", str(extra_bytes), cases, str(threads)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert result.returncode == 0, f"the child died (rc {result.returncode}): {result.stderr[-2000:]}"
    return json.loads(result.stdout.splitlines()[-1])


def _main() -> None:
    extra, cases, threads = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    module, name = cases.split(":")
    import cv2
    import torch

    cv2.setNumThreads(1)  # as the loader runs its decode threads (run/workers.py): no native pools,
    torch.set_num_threads(1)  # whose stacks and arenas would take this child's address space on 16 cores
    work = getattr(__import__(module, fromlist=[name]), name)()  # imports and inputs made first
    outcomes: dict[str, str] = {}
    limit = address_space() + extra + threads * (72 << 20)  # each thread's stack and malloc arena
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    def run(names: list[str]) -> None:
        for case in names:
            try:
                work[case]()
                outcomes[case] = "ok"
            except BaseException as error:  # noqa: BLE001 - reported to the parent
                outcomes[case] = f"{type(error).__name__}: {error}"

    names = sorted(work)
    pool = [threading.Thread(target=run, args=(names[start::threads],)) for start in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    outcomes["peak_rss_growth_mb"] = str((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before) // 1024)
    print(json.dumps(outcomes))


if __name__ == "__main__":
    _main()
