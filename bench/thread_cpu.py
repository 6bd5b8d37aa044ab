"""Where a sample's CPU goes, thread by thread: asyncload from local disk and from S3, in turn.

    python -m bench.thread_cpu [--rounds 2] [--quick] [--out FILE.json]

Why: "asyncload from S3 reaches N of its local rate" says nothing of what to cut. This splits the
CPU of one process (its defaults, in-process: ``processes=N`` children are not seen) over its
threads — the decode threads, the event loop, obstore's Rust runtime, the rest — and adds the
S3 server's own (SeaweedFS on the same cores, a cost a real bucket does not put on the node).
The event loop's share of one core is the figure to watch on a many-core node: one loop thread
near 100 % is the ceiling of one process.

Each round reads the bench's local image set from disk and then from SeaweedFS (fsspec-style
options, so obstore reads), a warm-up epoch and then ``EPOCHS`` measured ones; a thread is
sampled every 20 ms from /proc, so a thread's last 20 ms before it ends may be missed.
Linux only.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from bench.harness.dataset import DATA_ROOT, ensure_image_set
from bench.harness.s3data import upload
from bench.harness.tasks import image_decoder
from bench.harness.workloads import S3_BUCKET, image_set
from tests.support.s3server import S3_ENV, SeaweedFS, storage_options

EPOCHS = 3
POLL_S = 0.02
# thread name -> the group it is reported under (Python threads by their name, others by /proc comm)
GROUPS = {"asyncload-decode": "decode threads", "asyncload-decode-starter": "decode threads",
          "asyncload-loop": "event loop", "asyncload-read": "read threads",
          "tokio-runtime-w": "obstore (Rust) threads", "tokio-rt-worker": "obstore (Rust) threads"}


def thread_cpu() -> dict[int, tuple[str, float]]:
    """Every thread of this process: tid -> (its /proc name, CPU seconds so far)."""
    ticks = os.sysconf("SC_CLK_TCK")
    threads = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
            comm = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        except OSError:  # it ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        threads[int(tid)] = (comm, (int(fields[11]) + int(fields[12])) / ticks)  # utime + stime
    return threads


class Sampler(threading.Thread):
    """Keeps each thread's last CPU reading: the loader's threads live for one epoch each, so
    one reading at the end would miss them."""

    def __init__(self) -> None:
        super().__init__(name="thread-cpu-sampler", daemon=True)
        self.first = thread_cpu()
        self.last = dict(self.first)
        self.names: dict[int, str] = {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(POLL_S):
            self.last.update(thread_cpu())
            self.names.update({t.native_id: t.name for t in threading.enumerate() if t.native_id})

    def per_group(self) -> dict[str, float]:
        """CPU seconds each group spent between the start and the last reading."""
        spent: collections.Counter = collections.Counter()
        for tid, (comm, cpu) in self.last.items():
            if tid == self.native_id:
                continue
            name = re.sub(r"[-_]\d+$", "", self.names.get(tid, comm))  # asyncload-decode-3 -> asyncload-decode
            group = "main" if tid == os.getpid() else GROUPS.get(name, "other")
            spent[group] += cpu - self.first.get(tid, (comm, 0.0))[1]
        return dict(spent)


def server_cpu(pid: int) -> float:
    """User + system CPU seconds of the server process and its live children."""
    total = 0.0
    root = psutil.Process(pid)
    for process in [root, *root.children(recursive=True)]:
        try:
            total += sum(process.cpu_times()[:2])
        except psutil.Error:
            continue
    return total


def measure(source: Any, options: dict | None, server_pid: int) -> dict[str, Any]:
    """One loader at its defaults: samples/s and CPU ms per sample by group."""
    from asyncload import AsyncLoader

    with AsyncLoader(source, batch_size=256, shuffle=True, seed=0, decode=image_decoder(),
                     storage_options=options) as loader:
        for _ in loader:  # warm-up: connections, page cache, buffers
            pass
        server0, sampler = server_cpu(server_pid), Sampler()
        sampler.start()
        started, samples = time.perf_counter(), 0
        for epoch in range(1, EPOCHS + 1):
            loader.set_epoch(epoch)
            samples += sum(len(labels) for _, labels in loader)
        wall = time.perf_counter() - started
        sampler.done.set()
        sampler.join()
        server = server_cpu(server_pid) - server0
    groups = sampler.per_group()
    groups["S3 server"] = server
    per_sample = {group: 1e3 * seconds / samples for group, seconds in sorted(groups.items())}
    return {"samples_per_s": samples / wall, "cpu_ms_per_sample": per_sample,
            "event_loop_core_share": groups.get("event loop", 0.0) / wall}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="the quick image set (512 images)")
    parser.add_argument("--out", type=Path, default=None, help="write every run as JSON")
    args = parser.parse_args(argv)
    from asyncload import image_folder

    spec = image_set(args.quick)
    ensure_image_set(spec)
    os.environ.update(S3_ENV)
    runs = []
    with SeaweedFS() as server:
        upload(server.endpoint_url, spec.name)
        options = storage_options(server.endpoint_url)
        sources = {"local disk": (image_folder(str(DATA_ROOT / spec.name)), None),
                   "S3": (image_folder(f"s3://{S3_BUCKET}/{spec.name}", storage_options=options), options)}
        for number in range(args.rounds):
            for name, (source, source_options) in sources.items():
                run = {"round": number, "source": name, **measure(source, source_options, server.pid)}
                runs.append(run)
                figures = ", ".join(f"{g} {ms:.3f}" for g, ms in run["cpu_ms_per_sample"].items() if ms >= 0.0005)
                print(f"round {number} {name}: {run['samples_per_s']:.0f} samples/s; CPU ms per sample: {figures}; "
                      f"event loop {100 * run['event_loop_core_share']:.0f} % of a core", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"machine": os.uname().nodename, "cpus": os.cpu_count(), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
