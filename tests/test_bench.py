"""`python -m bench` with its output piped (a log file, CI, nohup) says what it does as it does it,
and a bench that is stopped keeps the runs it finished."""

from __future__ import annotations

import json
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The cheapest workload (synthetic, no data to generate), three runs: asyncload's defaults, then
# DataLoader with 2 and 4 workers (on 2 cores), whose epochs last seconds.
COMMAND = [sys.executable, "-m", "bench", "--quick", "--workloads", "large-samples",
           "--contenders", "asyncload", "DataLoader"]
EPOCH = re.compile(r"^    large-samples: asyncload default \| (warm-up|epoch 1): 1024 samples in [\d.]+ s, [\d,]+ samples/s$")
FIRST_RUN = re.compile(r"^\[1/(\d+), \d+ s\] large-samples: (asyncload default): ([\d,]+) samples/s")
SECOND_WARM_UP = re.compile(r"^    large-samples: DataLoader .*\| warm-up: ")


def _lines(stream, into: queue.Queue) -> None:
    """Every line as it comes, then None at end of file (once every process holding the pipe,
    the bench's workers included, has gone)."""
    for line in stream:
        into.put(line.rstrip("\n"))
    into.put(None)


def _kind(line: str) -> str | None:
    if match := EPOCH.match(line):
        return match.group(1)
    if FIRST_RUN.match(line):
        return "run 1"
    return "next run's warm-up" if SECOND_WARM_UP.match(line) else None


def test_a_piped_bench_prints_each_epoch_and_run_and_keeps_finished_runs_when_stopped(tmp_path):
    errors = (tmp_path / "stderr").open("w")
    out = tmp_path / "results"
    bench = subprocess.Popen([*COMMAND, "--out", str(out)], stdout=subprocess.PIPE, stderr=errors,
                             text=True, cwd=ROOT)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(bench.stdout, lines), daemon=True).start()
    seen: list[str] = []
    deadline = time.monotonic() + 90
    try:
        while not (seen and SECOND_WARM_UP.match(seen[-1])):
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None, f"output ended before the second run's warm-up: {seen}"
            seen.append(line)
        bench.send_signal(signal.SIGTERM)  # in the second run's measured epoch (seconds long)
        assert bench.wait(timeout=30) == 128 + signal.SIGTERM
        after = []
        while (line := lines.get(timeout=15)) is not None:  # Empty: a worker holds stdout still
            after.append(line)
        assert after == [], "the second run's worker went on after the bench stopped"
    finally:
        bench.kill()
        bench.wait()
        errors.close()
    stderr = (tmp_path / "stderr").read_text()[-2000:]

    # Each epoch's line came as it ended, then the run's line, then the next run's first epoch.
    kinds = [_kind(line) for line in seen if _kind(line)]
    assert kinds == ["warm-up", "epoch 1", "run 1", "next run's warm-up"], (seen, stderr)
    [(total, label, rate)] = [FIRST_RUN.match(line).groups() for line in seen if FIRST_RUN.match(line)]
    assert total == "3"

    # What the first run measured was on disk before its line was printed; the run cut short is not.
    [written] = out.glob("*.json")
    report = json.loads(written.read_text())
    assert report["partial"].startswith("1 of 3 runs done")
    [row] = report["results"]
    assert (row["label"], row["ok"]) == (label, True)
    assert f"{row['samples_per_s']:,.0f}" == rate
    table = written.with_suffix(".md").read_text()
    assert "**Partial**: 1 of 3 runs done" in table and f"**{label}**" in table
    assert not list(out.glob("*.tmp"))


def test_the_gpu_decode_bench_runs_its_quick_mode_on_the_cpu(tmp_path):
    """``python -m bench.gpu_decode --quick``: every contender and the model step, through
    nvImageCodec's CPU backend where there is no GPU; its JSON names each contender's rate and the
    default's split. A check of the code a lent GPU box runs, not a measurement."""
    import pytest

    pytest.importorskip("asyncload.decode.nvimgcodec")
    from asyncload.decode.nvimgcodec import available

    if not available():
        pytest.skip("nvImageCodec does not import")
    out = tmp_path / "gpu-decode.json"
    done = subprocess.run([sys.executable, "-m", "bench.gpu_decode", "--quick", "--samples", "32", "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(out.read_text())
    for run in ("no_model", "model"):
        assert set(results[run]["img_s"]) == {"default", "CPU only", "GPU only", "DataLoader(2)"}
        assert results[run]["img_s"]["DataLoader(2)"]["vs_dataloader"] == 1.0
        assert results[run]["default_split"].startswith("GPU decode (auto): GPU ")
    assert "the default's split: GPU decode (auto)" in done.stdout
