"""The results as JSON (everything), a Markdown table (the summary) and a PNG (the sweeps).

Ratios are taken against the best DataLoader configuration of the same workload and run, never
against numbers from another machine or another day.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

BASELINE = "DataLoader"


def _best_key(workload: dict):
    """What "best" means: throughput, except where the consumer is the bottleneck and every
    good loader ties on throughput; there it is the smallest share of time spent waiting."""
    if workload["name"] == "consumer-bound":
        return lambda row: -row["wait_share"]
    return lambda row: row["samples_per_s"]


def mark_best(results: list[dict], workloads: list[dict]) -> None:
    """Sets row["best"] on each contender's best config per workload, and row["ratio"] against
    the best DataLoader's samples/s."""
    by_name = {w["name"]: w for w in workloads}
    for row in results:  # marked again as results come in: a later row may be the best
        row.pop("best", None)
        row.pop("ratio", None)
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for row in results:
        if row.get("ok"):
            groups[(row["workload"], row["contender"])].append(row)
    for (workload, _), rows in groups.items():
        max(rows, key=_best_key(by_name[workload]))["best"] = True
    for row in results:
        base = [r for r in groups.get((row["workload"], BASELINE), []) if r.get("best")]
        if row.get("ok") and base:
            row["ratio"] = row["samples_per_s"] / base[0]["samples_per_s"]


def _mib(n: int | None) -> str:
    return f"{n / 2**20:,.0f}" if n else "-"


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def machine_speed(m: dict) -> str:
    """How fast the machine was during the run: the same VM can differ 2x from day to day."""
    rate, steal = m.get("decode_per_s"), m.get("cpu_steal_share")
    parts = []
    if rate is not None:
        parts.append(f"{m['usable_cores']} threads decoded {rate:.0f} images/s of this run's data just before it")
    if steal is not None:
        parts.append(f"{100 * steal:.1f} % of CPU time was stolen by the hypervisor during it")
    return "Machine speed: " + "; ".join(parts) + "." if parts else ""


def markdown(report: dict) -> str:
    """One table per workload, best row of each contender in bold, failures listed under it."""
    m, v = report["machine"], report["versions"]
    lines = [
        f"# asyncload benchmark: {m['cpu']}, {m['usable_cores']} cores, {m['memory_gib']} GiB, "
        f"GPU: {m['gpu'] or 'none'}",
        "",
        f"{report['started']}, {'quick' if report['settings']['quick'] else 'full'} mode, "
        f"{report['duration_s']:.0f} s. Python {v['python']}, torch {v['torch']}, "
        f"asyncload {v['asyncload']}, torchdata {v['torchdata'] or 'absent'}, spdl {v['spdl'] or 'absent'}.",
        "",
        machine_speed(m),
        *(["", f"**Partial**: {report['partial']} (the bench was stopped, or is still running)."]
          if report.get("partial") else []),
        "",
        "Each row is one process: a warm-up epoch, then the median samples/s of the measured epochs. "
        "First batch: from iter() to the first batch of the cold (first) epoch. CPU and peak RSS "
        "cover the process and all its children (worker processes). Wait: share of wall time the "
        "consumer was blocked on the loader, in brackets without each epoch's first batch. **Bold**: best configuration of each contender; "
        "x DL: samples/s over the best DataLoader's.",
    ]
    for workload in report["settings"]["workloads"]:
        rows = [r for r in report["results"] if r["workload"] == workload["name"]]
        lines += ["", f"## {workload['name']}: {workload['title']}", ""]
        lines.append(f"{workload['samples']} samples/epoch, batch {workload['batch_size']}"
                     + (f", step {workload['step_s'] * 1000:.0f} ms/batch" if workload["step_s"] else "")
                     + (f". {workload['note']}" if workload["note"] else ""))
        python_step = workload.get("step_kind") == "python"
        lines += ["", "| config | samples/s | x DL | s/batch | " + ("step ms (alone) | " if python_step else "")
                  + "first batch s | CPU s/1000 | peak RSS MiB | PSS MiB | wait (steady) |",
                  "|---|---:|---:|---:|" + ("---:|" if python_step else "") + "---:|---:|---:|---:|---:|"]
        for r in rows:
            if not r.get("ok"):
                continue
            name = f"**{r['label']}**" if r.get("best") else r["label"]
            step = (f"{1000 * r['step_s_per_batch']:.1f} ({1000 * r['step_alone_s']:.1f}) | "
                    if python_step and r.get("step_alone_s") else "- | " if python_step else "")
            lines.append(
                f"| {name} | {r['samples_per_s']:,.0f} | {_fmt(r.get('ratio'), '.2f')} | "
                f"{_fmt(r['s_per_batch'], '.3f')} | {step}{r['first_batch_s']:.2f} | {r['cpu_s_per_1000']:.2f} | "
                f"{_mib(r['peak_rss_bytes'])} | {_mib(r['peak_pss_bytes'])} | {r['wait_share']:.0%} "
                f"({_fmt(r.get('wait_share_steady'), '.0%')}) |")
        failed = [r for r in rows if not r.get("ok")]
        if failed:
            lines.append("")
            lines += [f"- not run / failed: {r['label']}: {r['error']}" for r in failed]
    cpu = report.get("s3_client_cpu")
    if cpu and cpu.get("ok"):
        lines += ["", "## S3 client CPU per GET", "",
                  f"{cpu['objects']} GETs of {cpu['object_bytes'] // 1000} KB, {cpu['in_flight']} in flight, from this "
                  f"run's S3 server (`python -m bench.s3_client_cpu`): obstore (the default) "
                  f"{cpu['obstore']['cpu_ms_per_get']:.2f} ms of CPU per GET, s3fs {cpu['s3fs']['cpu_ms_per_get']:.2f} ms "
                  f"({cpu['s3fs_over_obstore']:.1f}x); {cpu['obstore']['gets_per_s']:,.0f} against "
                  f"{cpu['s3fs']['gets_per_s']:,.0f} GETs/s from one event loop."]
    lines += gil_ceiling_lines(report.get("gil_ceiling"))
    if report.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in report["notes"]]
    return "\n".join(lines) + "\n"


def gil_ceiling_lines(figures: dict | None) -> list[str]:
    """The one-GIL proxy: what the pipeline's own Python per sample allows, beside bare loops."""
    if not figures:
        return []
    lines = ["", "## gil-ceiling: the pipeline's Python per sample, under one GIL", ""]
    if "rates" not in figures:
        return lines + [f"- failed: {figures.get('error')}"]
    lines += [f"{figures['samples']} files of 2 KB, a decode that sleeps {1000 * figures['sleep_s']:.0f} ms "
              f"(no GIL, no CPU), {figures['threads']} threads; best of the rounds.", "",
              "| loop | samples/s | of sleep-only |", "|---|---:|---:|"]
    reference = figures["rates"].get("threads: sleep only") or 1.0
    for name, rate in figures["rates"].items():
        lines.append(f"| {name} | {rate:,.0f} | {rate / reference:.2f} |")
    if figures.get("asyncload_cpu_us_per_sample"):
        lines += ["", f"asyncload in-process spent {figures['asyncload_cpu_us_per_sample']:.0f} µs of CPU per sample "
                      f"(the decode uses none): the pipeline's own work."]
    return lines


def plot(report: dict, path: Path) -> None:
    """samples/s against workers (DataLoader) or threads (the others), a panel per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    workloads = report["settings"]["workloads"]
    columns = min(3, len(workloads))
    rows = -(-len(workloads) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5.2 * columns, 4.2 * rows), squeeze=False)
    for ax in axes.flat[len(workloads):]:
        ax.set_visible(False)
    for ax, workload in zip(axes.flat, workloads):
        series: dict[str, list[tuple[int, float]]] = defaultdict(list)
        for r in report["results"]:
            if r["workload"] == workload["name"] and r.get("ok") and r.get("x") is not None:
                series[r["series"]].append((r["x"], r["samples_per_s"]))
        for name, points in sorted(series.items()):
            points.sort()
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", linestyle="-" if len(xs) > 1 else "none", label=name)
        ax.set_xscale("symlog", base=2, linthresh=1)  # 0 workers sits left of 1
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.set_title(workload["name"], fontsize=10)
        ax.set_xlabel("worker processes (DataLoader) / threads")
        ax.set_ylabel("samples/s")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    m = report["machine"]
    fig.suptitle(f"{m['cpu']}, {m['usable_cores']} cores, {report['started'][:10]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _replace(path: Path, text: str) -> None:
    """Writes through a temporary file, so a bench killed mid-write leaves the previous file whole."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def write_partial(report: dict, out_dir: Path, stem: str) -> dict[str, Path]:
    """Writes <stem>.json and .md under out_dir (cheap enough to do after every run); returns
    their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {ext: out_dir / f"{stem}.{ext}" for ext in ("json", "md")}
    _replace(paths["json"], json.dumps(report, indent=1, default=str))
    _replace(paths["md"], markdown(report))
    return paths


def write_all(report: dict, out_dir: Path, stem: str) -> dict[str, Path]:
    """Writes <stem>.json, .md and .png under out_dir; returns their paths."""
    paths = write_partial(report, out_dir, stem)
    paths["png"] = out_dir / f"{stem}.png"
    plot(report, paths["png"])
    return paths
