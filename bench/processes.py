"""In-process against ``processes=1``, ``processes=2`` and the default (``processes=None``,
which starts in-process and moves to children when the GIL is the limit), with a decode that
holds the GIL.

    python -m bench.processes [--samples 12000] [--rounds 3] [--ms 1.0] [--native ROUNDS]

The default is built afresh in every round, so its rate counts its measuring and its switch:
from its first batch to the epoch's end (its first batch's time, from ``AsyncLoader(...)``, is
printed apart). It runs twice a round: "default" in a fresh interpreter (a training script's
first loader: the fork server its children come from starts cold, torch imported there
first), and "default, 2nd loader" in this process, where the pinned loaders' children already
started the fork server. The pinned loaders are built once and warmed up.

The decode runs about ``--ms`` milliseconds of pure Python per sample (calibrated on this
machine first), so decode threads in one process take turns on one GIL; N processes have N
GILs. Every loader is built and warmed up once (the time to its first batch, processes' start
included, is printed; the rounds do not count it); then each
round times one epoch of each, in a rotating order so that the machine's drift (other users,
a neighbour VM) spreads over all of them, and checks that every loader delivered the same
samples in the same order. Prints the machine, each round's samples/s, the medians and their
ratios to the in-process rate.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from asyncload import AsyncLoader
from bench.harness.machine import cpu_model, cpu_ticks, steal_share

ROOT = Path(__file__).resolve().parent.parent
SIDE = 64  # each sample: a 64x64x3 uint8 "image" and its index


class GilDecode:
    """``loops`` iterations of a Python loop (holding the GIL), then a small image and the index."""

    def __init__(self, loops: int) -> None:
        self.loops = loops

    def __call__(self, index: int) -> tuple[np.ndarray, np.int64]:
        total = 0
        for step in range(self.loops):
            total += step ^ index
        return np.full((SIDE, SIDE, 3), (index + total) % 251, np.uint8), np.int64(index)


def calibrate(ms: float) -> int:
    """Loops that take ``ms`` milliseconds here (the fastest of a few tries: the least disturbed)."""
    probe = GilDecode(20_000)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        probe(1)
        best = min(best, time.perf_counter() - started)
    return max(1, int(20_000 * ms / 1000 / best))


def equal_priority(loaders: Any) -> str:
    """Child processes run at niceness 10 (out of the training process's way), in-process decode
    threads at this process's. To compare the loaders rather than their priority against the
    machine's other users, every child thread is put back to this process's niceness (which needs
    the privilege to raise a priority); failing that, this process goes down to the children's."""
    mine = os.nice(0)
    threads = [int(task) for process in psutil.Process().children(recursive=True)  # the loaders' children
               for task in os.listdir(f"/proc/{process.pid}/task")]
    try:
        for thread in threads:
            with contextlib.suppress(ProcessLookupError):  # a thread that ended since the listing
                os.setpriority(os.PRIO_PROCESS, thread, mine)
        return f"every process at niceness {mine} (the children's threads raised to this process's priority)"
    except PermissionError:
        os.nice(max(0, 10 - mine))
        return f"every process at niceness {os.nice(0)} (this process lowered to the children's priority)"


def cpu_seconds(processes: list[psutil.Process]) -> float:
    total = 0.0
    for process in processes:
        times = process.cpu_times()
        total += times.user + times.system
    return total


def epoch(loader: AsyncLoader, number: int) -> tuple[float, float, list[int]]:
    """Samples/s over one epoch, CPU milliseconds per sample (this process and the loader's
    children: a measure that other users of the machine do not skew), and the indices in
    delivery order."""
    loader.set_epoch(number)
    order: list[int] = []
    processes = [psutil.Process(), *psutil.Process().children(recursive=True)]  # the fork server's children too
    cpu = cpu_seconds(processes)
    started = time.perf_counter()
    for _, indices in loader:
        order.extend(indices.tolist())
    elapsed = time.perf_counter() - started
    return len(order) / elapsed, 1000 * (cpu_seconds(processes) - cpu) / len(order), order


def fresh_default(samples: int, batch_size: int, loops: int, number: int) -> tuple[float, float, list[int], str]:
    """A new ``processes=None`` loader's epoch ``number``: the time to its first batch, samples/s
    from that batch to the end, the indices in order, and what it chose (then it is closed)."""
    started = time.perf_counter()
    with AsyncLoader(list(range(samples)), batch_size=batch_size, seed=0, read=False, decode=GilDecode(loops)) as loader:
        loader.set_epoch(number)
        batches = iter(loader)
        _, indices = next(batches)
        first = time.perf_counter()
        order = indices.tolist()
        for _, indices in batches:
            order.extend(indices.tolist())
        rate = (len(order) - batch_size) / (time.perf_counter() - first)
        return first - started, rate, order, loader.stats.processes_choice or ""


def cold_default(samples: int, batch_size: int, loops: int, number: int,
                 flags: list[str]) -> tuple[float, float, list[int], str]:
    """``fresh_default`` in a fresh interpreter (``--one-default``): nothing started before it."""
    command = [sys.executable, "-m", "bench.processes", "--one-default", str(number), "--samples", str(samples),
               "--batch-size", str(batch_size), "--loops", str(loops), *flags]
    done = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT)
    return tuple(json.loads(done.stdout.splitlines()[-1]))  # type: ignore[return-value]


def native_rounds(rounds: int, samples: int) -> None:
    """The default against ``processes=0`` on native JPEG decode (``ImageDecoder``: GIL-free), on
    the bench's local image set: both warm, rounds interleaved. The default should stay."""
    from asyncload import ImageDecoder
    from bench.harness.dataset import ensure_image_set, list_image_folder
    from bench.harness.workloads import image_set

    items, _ = list_image_folder(ensure_image_set(image_set(quick=False)))
    items = (items * (samples // len(items) + 1))[:samples]
    loaders = {name: AsyncLoader(items, batch_size=128, seed=0, decode=ImageDecoder(), processes=count)
               for name, count in (("processes=0", 0), ("default", None))}
    try:
        for loader in loaders.values():
            epoch(loader, 0)
        ratios, cpu_ratios = [], []
        for number in range(rounds):
            rates, cpu = {}, {}
            for name in list(loaders)[number % 2:] + list(loaders)[: number % 2]:
                rates[name], cpu[name], _ = epoch(loaders[name], number + 1)
            ratios.append(rates["default"] / rates["processes=0"])
            cpu_ratios.append(cpu["default"] / cpu["processes=0"])
            print(f"native round {number + 1}: " + ", ".join(f"{name} {rate:.0f}/s" for name, rate in rates.items()))
        print(f"native JPEG decode: the default at {statistics.median(ratios):.3f}x processes=0 (per round "
              f"{min(ratios):.3f}-{max(ratios):.3f}x), CPU per sample {statistics.median(cpu_ratios):.3f}x (a measure "
              f"other users skew less); it chose: {loaders['default'].stats.processes_choice}")
    finally:
        for loader in loaders.values():
            loader.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=12000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ms", type=float, default=1.0, help="Python time per sample")
    parser.add_argument("--ignore-other-load", action="store_true",
                        help="the default's verdict leaves out other users' CPU, as on a machine of your own (a "
                             "shared box's other users take the core it would find idle, and it rightly stays)")
    parser.add_argument("--native", type=int, default=0, metavar="ROUNDS",
                        help="also this many rounds of native JPEG decode: the default against processes=0")
    parser.add_argument("--one-default", type=int, metavar="EPOCH", help=argparse.SUPPRESS)  # cold_default's run
    parser.add_argument("--loops", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ignore_other_load:
        import asyncload.adapt as adapt

        real = adapt.gil_bound
        adapt.gil_bound = lambda window: real({**window, "other_processes_cpu_seconds": 0.0})
    if args.one_default is not None:
        print(json.dumps(fresh_default(args.samples, args.batch_size, args.loops, args.one_default)))
        return

    if args.native and not args.rounds:
        native_rounds(args.native, 4 * 2048)
        return
    loops = calibrate(args.ms)
    cores = len(os.sched_getaffinity(0))
    steal = cpu_ticks()
    print(f"machine: {cpu_model()}, {cores} usable cores, load average {os.getloadavg()[0]:.1f}")
    if args.ignore_other_load:
        print("the default's verdict leaves out other processes' CPU (--ignore-other-load)")
    print(f"decode: {loops} Python loops = {args.ms} ms per sample here; {args.samples} samples, "
          f"batch {args.batch_size}, default num_threads ({cores} in all)")
    names = {"in-process": 0, "processes=1": 1, "processes=2": 2}
    loaders: dict[str, AsyncLoader] = {}
    try:
        first = {}
        for name, count in names.items():  # warm-up: processes started, threads and buffers created
            started = time.perf_counter()
            loaders[name] = AsyncLoader(list(range(args.samples)), batch_size=args.batch_size, seed=0, read=False,
                                        decode=GilDecode(loops), processes=count)
            batches = iter(loaders[name])
            next(batches)
            first[name] = time.perf_counter() - started
            for _ in batches:
                pass
        print("first batch, from AsyncLoader(...) (processes started): "
              + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in first.items()))
        print(equal_priority(loaders.values()))
        flags = ["--ignore-other-load"] if args.ignore_other_load else []
        defaults = {"default": lambda *numbers: cold_default(*numbers, flags=flags),
                    "default, 2nd loader": fresh_default}
        every = [*names, *defaults]
        rates: dict[str, list[float]] = {name: [] for name in every}
        cpu: dict[str, list[float]] = {name: [] for name in names}
        default_first: dict[str, list[float]] = {name: [] for name in defaults}
        for round_number in range(args.rounds):
            shift = round_number % len(every)
            turn = every[shift:] + every[:shift]
            orders = {}
            for name in turn:
                if name in defaults:
                    seconds, rate, orders[name], chose = defaults[name](args.samples, args.batch_size, loops,
                                                                        round_number + 1)
                    default_first[name].append(seconds)
                else:
                    rate, ms, orders[name] = epoch(loaders[name], round_number + 1)
                    cpu[name].append(ms)
                rates[name].append(rate)
            assert all(order == orders["in-process"] for order in orders.values()), "same samples, same order"
            print(f"round {round_number + 1}: " + ", ".join(f"{name} {rates[name][-1]:.0f}/s" for name in every)
                  + "; the defaults' first batch "
                  + ", ".join(f"{seconds[-1]:.2f} s" for seconds in default_first.values())
                  + f"; it chose: {chose}")
        base = statistics.median(rates["in-process"])
        for name in defaults:
            two = [rate / reference for rate, reference in zip(rates[name], rates["processes=2"])]
            print(f"{name} (fresh each round, from its first batch) against processes=2 (warm): "
                  f"{statistics.median(two):.2f}x (per round {min(two):.2f}-{max(two):.2f}x); first batch "
                  f"{max(default_first[name]):.2f} s at most")
        print("median samples/s (ratio to in-process; range of per-round ratios):")
        for name in every:
            ratios = [rate / reference for rate, reference in zip(rates[name], rates["in-process"])]
            used = f"; CPU {statistics.median(cpu[name]):.2f} ms/sample" if cpu.get(name) else ""
            print(f"  {name:<19} {statistics.median(rates[name]):6.0f}  ({statistics.median(rates[name]) / base:.2f}x; "
                  f"{min(ratios):.2f}-{max(ratios):.2f}x){used}")
        print(f"every round: the same samples in the same order from all {len(every)}")
        share = steal_share(steal, cpu_ticks())
        if share is not None:
            print(f"CPU stolen by the hypervisor during the run: {100 * share:.1f} %; "
                  f"load average now {os.getloadavg()[0]:.1f} (other users of the machine)")
    finally:
        for loader in loaders.values():
            loader.close()
    if args.native:
        native_rounds(args.native, 4 * 2048)


if __name__ == "__main__":
    main()
