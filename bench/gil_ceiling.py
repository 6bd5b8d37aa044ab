"""The one-GIL ceiling: samples/s when decode costs no GIL and no CPU.

A decoder whose ``decode_into`` only sleeps 2 ms stands for native decode that releases the GIL;
the files are small (2 KB), so reading them costs next to nothing. What is left is the Python
the pipeline runs per sample, under one GIL: on a many-core node that rate is the loader's
ceiling whatever the cores. Beside it, minimal loops of plain threads doing the same files and
the same sleep show what bare Python costs for the same work.

    python -m bench.gil_ceiling [--samples 8192] [--threads 64] [--repeat 3] [--json PATH]

``python -m bench`` runs it in a process of its own and puts its figures in every result.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np

from asyncload import AsyncLoader
from asyncload.batch.layout import Field
from bench.harness.machine import machine_info

SLEEP_S = 0.002
FILE_BYTES = 2048
DATA = Path(__file__).parent / "data" / "gil-ceiling"


class SleepDecoder:
    """Holds no GIL and no CPU for 2 ms a sample: native decode, minus the CPU."""

    field = Field((8,), np.dtype(np.uint8))

    def __call__(self, data: bytes) -> np.ndarray:
        time.sleep(SLEEP_S)
        return np.zeros(8, np.uint8)

    def decode_into(self, data: bytes, out: np.ndarray, key: object = None) -> None:
        time.sleep(SLEEP_S)
        out[0] = data[0]


def make_files(count: int) -> list[str]:
    """``count`` files of 2 KB under bench/data/gil-ceiling/ (made once)."""
    DATA.mkdir(parents=True, exist_ok=True)
    paths = [str(DATA / f"{i:06d}.bin") for i in range(count)]
    payload = os.urandom(FILE_BYTES)
    for path in paths:
        if not os.path.exists(path):
            with open(path, "wb") as f:
                f.write(payload)
    return paths


def asyncload_rate(paths: list[str], threads: int, batch_size: int = 256,
                   processes: int = 0) -> tuple[float, float]:
    """One warm-up epoch, then one measured epoch, with default settings but the thread count
    (with ``processes``, the threads are split among the processes): samples/s, and this
    process's CPU µs per sample (all of it in-process: the pipeline's Python, mostly)."""
    with AsyncLoader(paths, batch_size=batch_size, decode=SleepDecoder(), num_threads=threads,
                     processes=processes) as loader:
        for _ in loader:
            pass
        started, cpu_started = time.perf_counter(), time.process_time()
        count = sum(len(batch) for batch in loader)
        cpu_us = 1e6 * (time.process_time() - cpu_started) / count
        return count / (time.perf_counter() - started), cpu_us


def _split_threads(paths: list[str], threads: int, per_file: Callable[[str], None]) -> float:
    """Each of ``threads`` plain threads takes its share of ``paths``."""
    shares = [paths[i::threads] for i in range(threads)]
    workers = [threading.Thread(target=lambda share=share: [per_file(p) for p in share]) for share in shares]
    started = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return len(paths) / (time.perf_counter() - started)


def _sleep_only(path: str) -> None:
    time.sleep(SLEEP_S)


def _pread_known_size(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.pread(fd, FILE_BYTES, 0)
    finally:
        os.close(fd)
    time.sleep(SLEEP_S)


def _open_read(path: str) -> None:
    with open(path, "rb") as f:
        f.read()
    time.sleep(SLEEP_S)


def minimal_loops(paths: list[str], threads: int) -> dict[str, float]:
    """The reference loops of issue 16, samples/s each."""
    rates = {
        "threads: sleep only": _split_threads(paths, threads, _sleep_only),
        "threads: os.pread of the known size + sleep": _split_threads(paths, threads, _pread_known_size),
        "threads: open().read() + sleep": _split_threads(paths, threads, _open_read),
    }
    with ThreadPoolExecutor(threads) as pool:
        started = time.perf_counter()
        for future in [pool.submit(_open_read, p) for p in paths]:
            future.result()
        rates["ThreadPoolExecutor: a future per file"] = len(paths) / (time.perf_counter() - started)
    return rates


def measure(samples: int, threads: int, repeat: int) -> tuple[dict[str, float], float]:
    """Best of ``repeat`` rounds, each contender once a round, so they share the machine's moods;
    and the least CPU per sample of the in-process loader."""
    paths = make_files(samples)
    best: dict[str, float] = {}
    cpu_us = float("inf")
    for _ in range(repeat):
        in_process, cpu = asyncload_rate(paths, threads)
        cpu_us = min(cpu_us, cpu)
        rates = {"asyncload, defaults": in_process,
                 "asyncload, processes=2": asyncload_rate(paths, threads, processes=2)[0],
                 **minimal_loops(paths, threads)}
        for name, rate in rates.items():
            best[name] = max(best.get(name, 0.0), rate)
    return best, cpu_us


def main() -> None:  # spawned children import this module: its work stays under the guard below
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", type=str, default=None, help="also write the figures here")
    args = parser.parse_args()
    best, cpu_us = measure(args.samples, args.threads, args.repeat)
    if args.json:
        figures = {"samples": args.samples, "threads": args.threads, "sleep_s": SLEEP_S, "rates": best,
                   "asyncload_cpu_us_per_sample": cpu_us}
        with open(args.json, "w") as f:
            json.dump(figures, f)
    reference = best["threads: sleep only"]
    print(f"# GIL ceiling: {args.samples} files of {FILE_BYTES} B, a 2 ms GIL-free decode, {args.threads} threads")
    info = machine_info()
    print(f"# {info['cpu']}, {info['usable_cores']} usable cores, GPU: {info['gpu'] or 'none'}")
    print(f"{'':48} {'samples/s':>10} {'of sleep-only':>14}")
    for name, rate in best.items():
        print(f"{name:48} {rate:10,.0f} {rate / reference:14.2f}")
    print(f"asyncload in-process: {cpu_us:.0f} us of CPU per sample (the decode uses none)")


if __name__ == "__main__":
    main()
