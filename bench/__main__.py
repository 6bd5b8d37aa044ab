"""Side-by-side benchmark: asyncload against DataLoader, torchdata.nodes and SPDL.

    python -m bench --quick          # < 3 minutes on 2 cores
    python -m bench                  # < 15 minutes on 2 cores
    python -m bench --device cuda    # adds an end-to-end GPU training loop

Generates its data (cached under bench/data/), starts a local S3 server for the S3 workloads, runs
every (workload, contender, configuration) in a fresh process, and writes
bench/results/<machine>-<date>.{json,md,png} (<machine>-<date>-quick.* with --quick); a full run
into bench/results/ then draws the headline figure, docs/benchmark/headline.png (bench/headline.py:
each workload's default against the best DataLoader, from the latest full run's file).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import headline
from bench.harness.contenders import CONTENDERS
from bench.harness.dataset import ImageSetSpec, ensure_image_set
from bench.harness.machine import cpu_ticks, decode_rate, machine_info, machine_slug, steal_share, versions
from bench.harness.report import mark_best, markdown, write_all, write_partial
from bench.harness.runner import execute
from bench.harness.workloads import S3_NOTE, Workload, image_set, s3_image_set, workloads

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    names = [w.name for w in workloads(True)]
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small data, reduced sweeps")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda adds a training loop on the GPU (needs one)")
    parser.add_argument("--workloads", nargs="+", choices=names + ["train"], default=None,
                        metavar="NAME", help=f"subset of: {', '.join(names)} (default: all)")
    parser.add_argument("--contenders", nargs="+", choices=list(CONTENDERS), default=None,
                        metavar="NAME", help=f"subset of: {', '.join(CONTENDERS)} (default: all)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    return parser.parse_args(argv)


def check_device(device: str) -> None:
    """--device cuda without a GPU is a usage error: say so before spending any time."""
    if device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        sys.exit(f"--device cuda: no CUDA device is available to torch {torch.__version__} "
                 f"(torch.cuda.is_available() is False). Run without --device, or on a GPU machine "
                 f"with a CUDA build of torch.")


def select_workloads(args: argparse.Namespace) -> list[Workload]:
    chosen = workloads(args.quick)
    if args.device == "cuda":
        from bench.harness.train import train_workload

        chosen.append(train_workload(args.quick))
    if args.workloads:
        chosen = [w for w in chosen if w.name in args.workloads]
    return [calibrated(w) for w in chosen]


def calibrated(workload: Workload) -> Workload:
    """A Python step's loop count, measured here once, so every contender runs the same work."""
    if workload.step_kind != "python":
        return workload
    from bench.harness.steps import calibrate

    return dataclasses.replace(workload, python_loops=calibrate(workload.step_s))


def image_sets(chosen: list[Workload], quick: bool) -> dict[str, ImageSetSpec]:
    specs = {s.name: s for s in (image_set(quick), s3_image_set(quick))}
    return {w.dataset: specs[w.dataset] for w in chosen if w.is_image}


def plan(chosen: list[Workload], quick: bool, names: list[str]) -> tuple[list[dict], dict[str, str]]:
    """Every run to do, plus the contenders that cannot run here and why."""
    unavailable = {}
    runs = []
    for name in names:
        contender = CONTENDERS[name]
        reason = contender.unavailable()
        if reason:
            unavailable[name] = reason
    for workload in chosen:
        for name in names:
            contender = CONTENDERS[name]
            if name in unavailable:
                runs.append({"workload": workload.name, "contender": name, "label": name,
                             "config": {}, "skip": f"unavailable: {unavailable[name]}"})
                continue
            if not contender.supports(workload):
                continue
            for config in contender.configs(workload, quick):
                runs.append({"workload": workload.name, "contender": name, "config": config,
                             "label": contender.label(config), "x": contender.sweep_value(config),
                             "series": contender.series(config)})
    return runs, unavailable


def notes(chosen: list[Workload], quick: bool) -> list[str]:
    out = []
    if any(w.source.startswith("s3") for w in chosen):
        out.append(S3_NOTE + "; its CPU time (server_cpu_s in the JSON) is outside the measured "
                   "process tree but shares the same cores.")
    if quick:
        out.append("quick mode: small data, reduced sweeps, one measured epoch; timings are indicative only.")
    out.append("Time to first batch of DataLoader includes starting its worker processes; "
               "with persistent workers later epochs start faster (first_batch_warm_s in the JSON).")
    out.append("RSS sums count pages shared between processes once per process (DataLoader's "
               "shared-memory batches, libraries); PSS, sampled every ~1 s, splits them.")
    return out


def calibrate(sets: dict[str, ImageSetSpec], threads: int) -> float | None:
    """The machine's decode rate with one thread per core, on the first 256 images of the
    smallest image set the run uses (None when it uses none)."""
    if not sets:
        return None
    spec = min(sets.values(), key=lambda s: s.count)
    return decode_rate(sorted(spec.root.rglob("*.jpg"))[:256], threads)


def gil_ceiling(quick: bool) -> dict | None:
    """The one-GIL proxy (bench/gil_ceiling.py) in a fresh process: asyncload's samples/s with a
    decode that costs no GIL, beside minimal thread loops doing the same files."""
    with tempfile.TemporaryDirectory(prefix="asyncload-bench-") as tmp:
        out = Path(tmp) / "gil.json"
        command = [sys.executable, "-m", "bench.gil_ceiling", "--json", str(out)]
        command += ["--samples", "4096", "--repeat", "1"] if quick else []
        done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parent.parent, timeout=300)
        if done.returncode != 0 or not out.exists():
            return {"error": done.stderr.strip().splitlines()[-1:] or f"exit code {done.returncode}"}
        return json.loads(out.read_text())


def _stop_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM unwinds as Ctrl-C does: the running worker and the S3 server are stopped, and
    the results written so far stay."""
    sys.exit(128 + signum)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    check_device(args.device)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    started = dt.datetime.now()
    t0 = time.perf_counter()
    chosen = select_workloads(args)
    sets = image_sets(chosen, args.quick)
    for spec in sets.values():
        ensure_image_set(spec)
    names = args.contenders or list(CONTENDERS)
    runs, unavailable = plan(chosen, args.quick, names)
    for name, reason in unavailable.items():
        print(f"{name}: not run here: {reason}")
    info = machine_info()
    info["decode_per_s"] = calibrate(sets, info["usable_cores"])
    ticks = cpu_ticks()
    report = {
        "machine": info, "versions": versions(), "started": started.isoformat(timespec="seconds"),
        "duration_s": 0.0, "unavailable": unavailable,
        "settings": {"quick": args.quick, "device": args.device, "argv": sys.argv[1:],
                     "workloads": [w.to_dict() for w in chosen], "contenders": names},
        "results": [], "notes": notes(chosen, args.quick),
    }
    # A quick check must not overwrite the day's full results.
    stem = f"{machine_slug(info)}-{started:%Y-%m-%d}" + ("-quick" if args.quick else "")
    planned = sum("skip" not in r for r in runs)
    print(f"{planned} runs; {args.out / stem}.json and .md are rewritten after each", flush=True)

    def save(results: list[dict]) -> None:
        """The results so far, on disk before the run's line is printed: a bench that is
        stopped keeps every run it finished (the plot is drawn at the end only)."""
        done = sum("skip" not in r for r in results)
        report.update(results=results, duration_s=time.perf_counter() - t0,
                      partial=f"{done} of {planned} runs done when this was written")
        mark_best(results, report["settings"]["workloads"])
        write_partial(report, args.out, stem)

    extras: dict = {}
    results = execute(runs, chosen, args.device, args.quick, extras, on_result=save)
    print("gil-ceiling (python -m bench.gil_ceiling)", flush=True)
    extras["gil_ceiling"] = gil_ceiling(args.quick)
    info["cpu_steal_share"] = steal_share(ticks, cpu_ticks())
    report.pop("partial", None)
    report.update(results=results, duration_s=time.perf_counter() - t0, **extras)
    mark_best(results, report["settings"]["workloads"])
    paths = write_all(report, args.out, stem)
    if not args.quick and args.out.resolve() == RESULTS:
        paths["headline"] = headline.draw(RESULTS, headline.FIGURE)
    print(markdown(report))
    print("wrote " + ", ".join(str(p) for p in paths.values()))


if __name__ == "__main__":
    main()
