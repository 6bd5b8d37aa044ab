"""The headline figure: for each workload, asyncload's default against the best ``DataLoader`` of
the same run, as a ratio, on a page a person reads in five seconds (the sweeps are the 7-panel
PNG beside each result file; the tables are in docs/benchmark/results.md).

    python -m bench.headline       # from the committed results: docs/benchmark/headline.png

Drawn from files, never from a new run: the latest full ``python -m bench`` run in
``bench/results/`` (the run of the latest day with the most workloads: a rerun of one workload
the same day does not replace the comparison), and, where present, the 16-core GPU box's
``*-cores.txt`` (``python -m bench.cores``) and ``*-loaders-procs.json``. ``python -m bench``
draws it again after a full run.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
FIGURE = Path(__file__).resolve().parent.parent / "docs" / "benchmark" / "headline.png"

# What each workload is called on the figure (the results' titles are long)
LABELS = {
    "imagenet-local": "local JPEGs",
    "imagenet-s3": "S3 (same-box server)",
    "imagenet-s3-latency": "S3 + 20-50 ms latency",
    "shards-s3-latency": "tar shards, S3 + latency",
    "large-samples": "large samples",
    "consumer-bound": "consumer-bound step",
    "python-step": "Python-bound step",
}
# A workload without DataLoader rows is compared with the DataLoader of the same images read one
# object at a time (DataLoader does not read tar shards by itself)
BASELINE_OF = {"shards-s3-latency": "imagenet-s3-latency"}


@dataclass(frozen=True)
class Row:
    """One bar: asyncload's default and the best DataLoader, samples/s, on one machine."""

    label: str
    ours: float
    theirs: float
    baseline: str  # which DataLoader, as its run named it

    @property
    def ratio(self) -> float:
        return self.ours / self.theirs


def latest_run(folder: Path) -> Path:
    """The latest full ``python -m bench`` run in ``folder`` (see the module)."""
    runs = []
    for path in folder.glob("*.json"):
        report = json.loads(path.read_text())
        settings = report.get("settings") if isinstance(report, dict) else None
        if not settings or settings.get("quick") or "partial" in report or not report.get("results"):
            continue
        runs.append((report["started"][:10], len(settings["workloads"]), report["started"], path))
    if not runs:
        raise FileNotFoundError(f"no full `python -m bench` run in {folder}")
    return max(runs)[-1]


def run_rows(report: dict) -> list[Row]:
    """asyncload's default against the best DataLoader, per workload of one run."""
    ok = [row for row in report["results"] if row.get("ok")]

    def best_dataloader(workload: str) -> dict | None:
        rows = [row for row in ok if row["workload"] == workload and row["contender"] == "DataLoader"]
        return max(rows, key=lambda row: row["samples_per_s"], default=None)

    out = []
    for workload in report["settings"]["workloads"]:
        name = workload["name"]
        default = next((row for row in ok if row["workload"] == name and row["contender"] == "asyncload"
                        and row["config"].get("tag") == "default"), None)
        base = best_dataloader(name)
        single = base is None and name in BASELINE_OF
        base = base or best_dataloader(BASELINE_OF.get(name, name))
        if default is None or base is None:
            continue
        label = LABELS.get(name, name) + f", batch {workload['batch_size']}"
        workers = base["config"].get("num_workers")
        baseline = (f"{workers} workers" if workers is not None else base["label"]) + (" on objects" if single else "")
        out.append(Row(label, default["samples_per_s"], base["samples_per_s"], baseline))
    return out


def cores_row(path: Path) -> Row | None:
    """``python -m bench.cores``'s printout: the default's 2nd epoch against ``DataLoader(N)``,
    medians over its rounds."""
    ours, theirs, workers = [], [], None
    for line in path.read_text().splitlines():
        if not line.startswith("round "):
            continue
        dataloader = re.search(r"DataLoader\((\d+)\) (\d+)/s", line)
        default = re.search(r"default, 2nd epoch (\d+)/s", line)
        if dataloader and default:
            workers = dataloader.group(1)
            theirs.append(float(dataloader.group(2)))
            ours.append(float(default.group(1)))
    if not ours:
        return None
    return Row("16 cores: JPEGs, batches to the GPU", statistics.median(ours), statistics.median(theirs),
               f"{workers} workers")


def procs_row(path: Path) -> Row | None:
    """``loaders_procs.py``'s JSON: the default (in-process start) against ``DataLoader(16)``."""
    found = {row["name"]: row["img_s"] for row in json.loads(path.read_text()).get("results", [])}
    if "asyncload_cuda_inproc" not in found or "dataloader_samedecode_w16" not in found:
        return None
    return Row("16 cores: JPEGs, float on the GPU", found["asyncload_cuda_inproc"],
               found["dataloader_samedecode_w16"], "16 workers")


def gpu_rows(folder: Path) -> tuple[list[Row], str | None]:
    """The 16-core GPU box's rows from its latest files (none: ``[], None``) and its caption:
    its machine from ``bench.cores``'s printout, its date from the file names."""
    cores = sorted(folder.glob("*-cores.txt"))  # not "-cores-before.txt": the code before a change
    procs = sorted(folder.glob("*-loaders-procs.json"))
    rows = [row for row in (cores_row(cores[-1]) if cores else None, procs_row(procs[-1]) if procs else None) if row]
    if not rows:
        return [], None
    machine = re.search(r"machine: ([^,]+), (\d+) usable cores, ([^;]+);", cores[-1].read_text()) if cores else None
    date = re.search(r"\d{4}-\d{2}-\d{2}", (cores or procs)[-1].name)
    cpu = re.sub(r"\(R\)|\(TM\)| Processor| CPU", "", machine.group(1)).strip() if machine else ""
    caption = f"{machine.group(2)}-core {cpu} + {machine.group(3)}" if machine else "16-core GPU box"
    return rows, caption + (f", {date.group()}" if date else "")


def draw(folder: Path = RESULTS, out: Path = FIGURE) -> Path:
    """Draws the headline figure from the results in ``folder`` into ``out``; returns ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_path = latest_run(folder)
    report = json.loads(run_path.read_text())
    rows = run_rows(report)
    extra, gpu_caption = gpu_rows(folder)
    machine = report["machine"]
    caption = f"{machine['usable_cores']}-core {machine['cpu']} VM, no GPU, {report['started'][:10]}"
    everything = rows + extra
    fig, ax = plt.subplots(figsize=(10, 0.55 * len(everything) + 2.1))
    positions = list(range(len(everything)))[::-1]  # the first row at the top
    colours = ["#2a9d4b" if row.ratio >= 1.05 else "#c0392b" if row.ratio < 0.95 else "#7f8c8d" for row in everything]
    ax.barh(positions, [row.ratio for row in everything], color=colours, height=0.62, left=0)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_xscale("log", base=2)
    top = max(row.ratio for row in everything)
    right = top * 14  # room for the longest bar's figures
    ax.set_xlim(0.25, right)
    ticks = [t for t in (0.25, 0.5, 1, 2, 4, 8, 16, 32, 64) if t <= top * 2]
    ax.set_xticks(ticks, [f"{t:g}×" for t in ticks])
    ax.set_yticks(positions, [row.label for row in everything])
    for y, row in zip(positions, everything):
        ax.text(max(row.ratio, 1.0) * 1.06, y, f"{row.ratio:.2f}×  ({row.ours:,.0f} vs {row.theirs:,.0f}/s, {row.baseline})",
                va="center", fontsize=8.5, fontweight="bold" if row.ratio >= 1.05 else "normal")
    if extra:  # the GPU box's rows under a line of their own, named on it
        ax.axhline(len(extra) - 0.5, color="grey", linewidth=0.8, linestyle="--")
        ax.text(right * 0.95, len(extra) - 0.6, gpu_caption, fontsize=8, color="dimgrey", va="top", ha="right")
        ax.text(right * 0.95, len(extra) - 0.4, caption, fontsize=8, color="dimgrey", va="bottom", ha="right")
    ax.set_xlabel("asyncload's default ÷ the best DataLoader (samples/s; right of the line: asyncload faster)")
    title = f"asyncload's default against the best DataLoader, per workload\n{caption}"
    if gpu_caption:
        title += f"\nbelow the dashed line: {gpu_caption}"
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="the folder of result files")
    parser.add_argument("--out", type=Path, default=FIGURE, help="the PNG to write")
    args = parser.parse_args(argv)
    print(f"wrote {draw(args.results, args.out)}")


if __name__ == "__main__":
    main()
