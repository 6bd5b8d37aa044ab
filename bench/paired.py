"""asyncload's defaults against ``"auto"`` (and optionally one hand-tuned setting), in alternation.

    python -m bench.paired imagenet-local
    python -m bench.paired imagenet-s3-latency --tuned '{"io_concurrency": 256}' --rounds 3

On a shared VM the same configuration moves by 10-20 % between runs a minute apart, more than
the differences a tuner is judged by. Running the configurations in turn, round after round,
exposes each round's pair to the same drift: the per-round ratios, and their spread, say what one
run of the full bench cannot. Each run is a fresh process, measured as in ``python -m bench``.
"""

from __future__ import annotations

import argparse
import json
import statistics

from bench.__main__ import image_sets
from bench.harness.contenders import CONTENDERS
from bench.harness.dataset import ensure_image_set
from bench.harness.runner import execute
from bench.harness.workloads import workloads

AUTO = {"tag": "auto", "num_threads": "auto", "io_concurrency": "auto"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workload", choices=[w.name for w in workloads(False)])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tuned", type=json.loads, help="a hand-tuned setting as JSON, also run each round")
    args = parser.parse_args(argv)
    workload = next(w for w in workloads(False) if w.name == args.workload)
    for spec in image_sets([workload], False).values():
        ensure_image_set(spec)
    contender = CONTENDERS["asyncload"]
    configs = [{"tag": "default"}, AUTO] + ([{"tag": "tuned", **args.tuned}] if args.tuned else [])
    runs = [{"workload": workload.name, "contender": "asyncload", "config": config,
             "label": contender.label(config), "x": None, "series": ""}
            for _ in range(args.rounds) for config in configs]
    rates: dict[str, list[float]] = {}
    for result in execute(runs, [workload], "cpu", False):
        rates.setdefault(result["label"], []).append(result.get("samples_per_s") or 0.0)
    for label, values in rates.items():
        print(f"{label}: samples/s {', '.join(f'{v:.0f}' for v in values)}")
    auto = rates[contender.label(AUTO)]
    for label, values in rates.items():
        if values is not auto:
            ratios = [a / b for a, b in zip(auto, values) if b]
            print(f"auto / {label}: {', '.join(f'{r:.2f}' for r in ratios)} (median {statistics.median(ratios):.2f})")


if __name__ == "__main__":
    main()
