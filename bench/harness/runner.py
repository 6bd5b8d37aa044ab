"""Runs a bench plan: each (workload, contender, configuration) in a fresh `python -m bench.harness.worker`
process, one after the other, with the S3 servers up when the plan reads from S3.

Progress is printed as lines, flushed as they happen, so that a run whose output goes to a file or
a pipe says what it is doing: the worker prints a line per epoch (its elapsed time and rate), and
this module a line per finished run. ``on_result`` sees the results after every run, so a caller
can write them at once and a bench that is stopped keeps what it measured.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

from bench.harness.s3data import s3_servers
from bench.harness.workloads import S3_BUCKET, Workload

ROOT = Path(__file__).resolve().parents[2]


def _server_cpu(pids: list[int]) -> float:
    """CPU seconds used so far by the S3 server and proxy (outside the measured process tree)."""
    import psutil

    total = 0.0
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total


def run_name(run: dict) -> str:
    """"workload: label", once (some callers already put the workload in the label)."""
    label = run["label"]
    return label if label.startswith(f"{run['workload']}:") else f"{run['workload']}: {label}"


def run_one(run: dict, workload: Workload, storage: dict, device: str, timeout: float,
            server_pids: list[int]) -> dict:
    """One fresh `python -m bench.harness.worker` process; its own session, so a hung run and its workers
    can be killed together (also when this process is interrupted: a worker must not outlive
    the bench). It inherits stdout, where it prints its per-epoch lines."""
    with tempfile.TemporaryDirectory(prefix="asyncload-bench-") as tmp:
        result_path = Path(tmp) / "result.json"
        spec = {"workload": workload.to_dict(), "contender": run["contender"], "config": run["config"],
                "device": device, "storage_options": storage.get(workload.source),
                "result_path": str(result_path), "label": run_name(run)}
        cpu0 = _server_cpu(server_pids)
        started = time.perf_counter()
        sys.stdout.flush()  # our lines before the worker's, which go straight to the same file
        proc = subprocess.Popen([sys.executable, "-m", "bench.harness.worker"], stdin=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True, cwd=ROOT)
        try:
            _, stderr = proc.communicate(json.dumps(spec), timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return {**run, "ok": False, "error": f"timed out after {timeout:.0f} s"}
        except BaseException:  # Ctrl-C, SIGTERM: stop the worker and its children too
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        if result_path.exists():
            result = json.loads(result_path.read_text())
        else:
            tail = stderr.strip().splitlines()[-3:]
            result = {"ok": False, "error": f"worker exited with code {proc.returncode}: {' | '.join(tail)}"}
    result["run_wall_s"] = time.perf_counter() - started  # process start to exit, for budgeting
    if server_pids:
        result["server_cpu_s"] = _server_cpu(server_pids) - cpu0
    return {**run, **result}


def result_line(row: dict, done: int, total: int, elapsed_s: float) -> str:
    """The line printed when a run ends: which, its median rate or why it failed, how long."""
    head = f"[{done}/{total}, {elapsed_s:.0f} s] {run_name(row)}"
    if not row.get("ok"):
        return f"{head}: failed: {row.get('error')}"
    chose = f"\n    {row['processes_choice']}" if row.get("processes_choice") else ""
    return (f"{head}: {row['samples_per_s']:,.0f} samples/s (median of {row['epochs_measured']} "
            f"epoch(s)), run {row['run_wall_s']:.1f} s{chose}")


def execute(runs: list[dict], chosen: list[Workload], device: str, quick: bool, extras: dict | None = None,
            on_result: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """Runs the plan, with the S3 server up only if an S3 workload is in it; then, with that
    server, the client CPU per GET of obstore and s3fs into ``extras["s3_client_cpu"]``.
    ``on_result(results so far)`` is called after each run, before its line is printed."""
    by_name = {w.name: w for w in chosen}
    s3_sets = {w.dataset for w in chosen if w.source.startswith("s3") and not w.samples_per_shard}
    shard_sets = {w.shard_set: (w.dataset, w.samples_per_shard) for w in chosen if w.samples_per_shard}
    latency = any(w.source == "s3-latency" for w in chosen)
    servers = s3_servers(s3_sets, shard_sets, latency) if s3_sets or shard_sets else nullcontext({})
    timeout = 120 if quick else 300
    total = sum("skip" not in r for r in runs)
    results: list[dict] = []
    started = time.perf_counter()
    with servers as storage:
        pids = list(storage.get("pids", []))
        for run in runs:
            if "skip" in run:
                results.append({**run, "ok": False, "error": run["skip"]})
                continue
            row = run_one(run, by_name[run["workload"]], storage, device, timeout, pids)
            results.append(row)
            if on_result is not None:
                on_result(results)
            done = sum("skip" not in r for r in results)
            print(result_line(row, done, total, time.perf_counter() - started), flush=True)
        if extras is not None and "s3" in storage:
            print("S3 client CPU per GET (python -m bench.s3_client_cpu)", flush=True)
            extras["s3_client_cpu"] = client_cpu(storage["s3"]["endpoint_url"], quick)
    return results


def client_cpu(endpoint_url: str, quick: bool) -> dict:
    """``python -m bench.s3_client_cpu`` against the run's server, in a process of its own (its
    CPU time is the figure)."""
    command = [sys.executable, "-m", "bench.s3_client_cpu", "--json", "--endpoint", endpoint_url,
               "--bucket", S3_BUCKET, "--objects", "300" if quick else "1000"]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=300, cwd=ROOT)
    if done.returncode != 0:
        return {"ok": False, "error": done.stderr.strip()[-2000:]}
    return {"ok": True, **json.loads(done.stdout)}
