"""asyncload from S3 against itself from local disk and against DataLoader from S3, in alternation.

    python -m bench.s3_paired [--rounds 3] [--quick] [--out FILE.json]

Each round runs, each in a fresh process as ``python -m bench`` does: asyncload's defaults on
``imagenet-local``, then on ``imagenet-s3`` (the same files from SeaweedFS, fsspec-style
options, so obstore reads), asyncload with s3fs (``client="fsspec"``), and DataLoader with 2 and
4 workers from S3 (its best rows on 2 cores). On a shared VM a configuration moves by 10-20 %
within minutes; ratios taken within one round share that drift, so their spread over rounds is
the figure to quote. The client CPU per GET is measured once, against the same server.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from bench.__main__ import image_sets
from bench.harness.contenders import CONTENDERS
from bench.harness.dataset import ensure_image_set
from bench.harness.runner import execute
from bench.harness.workloads import workloads

ROWS = [  # (workload, contender, config)
    ("imagenet-local", "asyncload", {"tag": "default"}),
    ("imagenet-s3", "asyncload", {"tag": "default"}),
    ("imagenet-s3", "asyncload", {"tag": "s3fs", "client": "fsspec"}),
    ("imagenet-s3", "DataLoader", {"num_workers": 2, "prefetch_factor": 2}),
    ("imagenet-s3", "DataLoader", {"num_workers": 4, "prefetch_factor": 2}),
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="the quick image set (512 images)")
    parser.add_argument("--out", type=Path, default=None, help="write every run and the ratios as JSON")
    args = parser.parse_args(argv)
    chosen = [w for w in workloads(args.quick) if w.name in ("imagenet-local", "imagenet-s3")]
    for spec in image_sets(chosen, args.quick).values():
        ensure_image_set(spec)
    runs = [{"workload": name, "contender": contender, "config": config, "round": number,
             "label": f"{name}: {CONTENDERS[contender].label(config)}", "x": None, "series": ""}
            for number in range(args.rounds) for name, contender, config in ROWS]
    extras: dict = {}
    results = execute(runs, chosen, "cpu", args.quick, extras)
    rate = {(r["round"], r["label"]): r.get("samples_per_s") or 0.0 for r in results}
    labels = list(dict.fromkeys(r["label"] for r in runs))
    for label in labels:
        print(f"{label}: samples/s {', '.join(f'{rate[(n, label)]:.0f}' for n in range(args.rounds))}")
    local, s3, s3fs = labels[0], labels[1], labels[2]
    ratios = {
        "s3 / local": [rate[(n, s3)] / rate[(n, local)] for n in range(args.rounds)],
        "s3 / best DataLoader": [rate[(n, s3)] / max(rate[(n, label)] for label in labels[3:]) for n in range(args.rounds)],
        "s3 / s3fs": [rate[(n, s3)] / rate[(n, s3fs)] for n in range(args.rounds)],
    }
    for name, values in ratios.items():
        print(f"asyncload default {name}: {', '.join(f'{v:.2f}' for v in values)} (median {statistics.median(values):.2f})")
    cpu = extras.get("s3_client_cpu", {})
    if cpu.get("ok"):
        print(f"client CPU per GET: obstore {cpu['obstore']['cpu_ms_per_get']:.2f} ms, s3fs {cpu['s3fs']['cpu_ms_per_get']:.2f} ms")
    if args.out:
        args.out.write_text(json.dumps({"results": results, "ratios": ratios, **extras}, indent=1))


if __name__ == "__main__":
    main()
