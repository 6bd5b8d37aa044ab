"""The per-sample cost of writing a decoded sample into its batch row on the fast path (fixed
shapes, a decode without ``decode_into``): ``SampleLayout.flatten`` (the sample's structure
checked and its arrays taken in the layout's order, a dict's by key) and ``BatchBuffer.write``
(that and the row copies), for the common sample shapes.

    python -m bench.write_cost [--against PATH] [--rounds 6]

CPU time of the measuring thread, the least of many short runs: on a machine shared with other
work, wall time swings several-fold, CPU time much less. With ``--against`` another checkout of
asyncload (say, main's) is measured too, each round in a fresh process of each checkout in turn,
so both share the machine's moods, and the ratio (this checkout / the other) is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent


def samples() -> dict[str, Any]:
    import numpy as np
    import torch

    image = np.zeros((8, 8, 3), np.uint8)
    return {
        "array": image,
        "tuple (image, label)": (image, np.int64(3)),
        "dict {image, label}": {"image": image, "label": np.int64(3)},
        "dict nested, 4 leaves": {"image": image, "meta": {"w": np.int32(1), "h": np.int32(2)}, "label": np.int64(3)},
        "tuple (tensor, int)": (torch.zeros(8, 8, 3, dtype=torch.uint8), 3),
    }


def least_us(call: Callable[[], Any], runs: int = 40, calls: int = 2000) -> float:
    """The least CPU time of one call, in microseconds, over ``runs`` runs of ``calls`` calls."""
    best = float("inf")
    for _ in range(runs):
        started = time.thread_time()
        for _ in range(calls):
            call()
        best = min(best, time.thread_time() - started)
    return best / calls * 1e6


def measure() -> dict[str, list[float]]:
    """``[flatten us, write us]`` of each sample shape, with the asyncload on ``sys.path``."""
    from asyncload.batch.buffers import BufferRing
    from asyncload.batch.layout import SampleLayout

    figures = {}
    for name, sample in samples().items():
        layout = SampleLayout.of(sample)
        ring = BufferRing(2, False)
        ring.configure(layout, 64)
        buffer = ring.take()
        figures[name] = [least_us(lambda: layout.flatten(sample)), least_us(lambda: buffer.write(5, sample))]
    return figures


def in_process_of(checkout: Path) -> dict[str, list[float]]:
    """``measure()`` in a fresh process that imports asyncload from ``checkout``."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}  # run as a script: no checkout's folder comes first
    out = subprocess.run([sys.executable, __file__, "--json-only"], env=env, cwd=checkout,
                         capture_output=True, text=True, check=True)
    figures = json.loads(out.stdout)
    imported = Path(figures.pop("from")).resolve()
    assert imported.is_relative_to(checkout), f"measured {imported}, not {checkout}"
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", type=Path, default=None, help="another checkout of asyncload to compare with")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--json-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.json_only:
        import asyncload

        print(json.dumps({**measure(), "from": asyncload.__file__}))
        return
    checkouts = [ROOT] + ([args.against.resolve()] if args.against else [])
    best: dict[Path, dict[str, list[float]]] = {checkout: {} for checkout in checkouts}
    for _ in range(args.rounds):
        for checkout in checkouts:
            for name, figures in in_process_of(checkout).items():
                old = best[checkout].get(name, [float("inf")] * 2)
                best[checkout][name] = [min(a, b) for a, b in zip(old, figures)]
    from bench.harness.machine import machine_info

    info = machine_info()
    print(f"# write cost per sample, CPU us (least of {args.rounds} rounds); {info['cpu']}, "
          f"{info['usable_cores']} usable cores; load {os.getloadavg()[0]:.1f}")
    head = f"{'':24} {'flatten':>8} {'write':>8}"
    if args.against:
        head += f" {'flatten (other)':>16} {'write (other)':>14} {'ratio flatten':>14} {'ratio write':>12}"
    print(head)
    for name, (flatten, write) in best[ROOT].items():
        line = f"{name:24} {flatten:8.2f} {write:8.2f}"
        if args.against:
            other_flatten, other_write = best[checkouts[1]][name]
            line += (f" {other_flatten:16.2f} {other_write:14.2f} {flatten / other_flatten:14.2f}"
                     f" {write / other_write:12.2f}")
        print(line)


if __name__ == "__main__":
    main()
