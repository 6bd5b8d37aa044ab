"""Memory over a run: RSS and PSS of each loader's process tree, sampled every 0.2 s over 3 epochs.

    python -m bench.memory                    # 3-4 minutes on 2 cores
    python -m bench.memory --cases local-asyncload local-dataloader

Each case runs in a fresh `python -m bench.memory --child` process: a background thread sums RSS,
PSS and USS over the process and its descendants (DataLoader's workers, asyncload's children with
`processes=N`) every `--interval` seconds, and once more at each mark (list built, loader built,
end of each epoch). Three workloads, each for asyncload's defaults and DataLoader with 2 workers
(fork, Linux's default, `persistent_workers=True`):

- `local`: the bench's 2,048 local JPEGs (`imagenet-local`), 3 epochs of all of them.
- `biglist`: a dataset holding a plain Python list of `--items` (1.5 million) `(path, label)`
  tuples, each with its own path string (as a listing of a real 1.5-million-image set gives),
  pointing at the same JPEGs over and over. Each epoch reads a fresh random subset of
  `--epoch-samples` of them (the same subset for both loaders), so the run stays short while the
  list lives in the dataset: DataLoader's sampler draws it, asyncload reads a view of the list.
  A forked worker shares the parent's pages until it writes to them, and reading an item writes
  to it (its reference count): every item a worker reads copies the pages holding it into that
  worker, so its PSS grows with every sample, until, after enough epochs, each worker holds its
  own copy of the whole list (https://github.com/pytorch/pytorch/issues/13246).
- `listonly`: the same list, every item of it each epoch (shuffled), each sample only the item's
  path length and label (no file read, so an epoch of 1.5 million takes seconds): where that
  copying ends, each worker holding its own copy of the list.

Writes bench/results/<machine>-<date>-memory.{json,png} and prints, per case: peak RSS, peak
PSS, PSS at the end of epochs 1, 2 and 3, and the growth from the end of epoch 1 to the end of
epoch 3. Reading PSS makes the kernel walk each process's page tables (a few ms per process), so
the sampler itself costs a few % of a core at 0.2 s.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent
INTERVAL_S = 0.2
EPOCHS = 3
ITEMS = 1_500_000
EPOCH_SAMPLES = 4096
BATCH = 256
CASES = ("local-asyncload", "local-dataloader", "biglist-asyncload", "biglist-dataloader",
         "listonly-asyncload", "listonly-dataloader", "gil-asyncload")
GIL_SAMPLES = 6000  # gil-asyncload: samples per epoch of the 1 ms-of-Python decode
LABELS = {f"{workload}-{name}": label for workload in ("local", "biglist", "listonly")
          for name, label in (("asyncload", "asyncload (defaults)"), ("dataloader", "DataLoader num_workers=2"))}
LABELS["gil-asyncload"] = "asyncload (defaults), a decode of 1 ms of Python: the default moves to children"


def tree_sample(root: psutil.Process) -> dict:
    """RSS, PSS and USS summed over the tree, the children's PSS and USS apart, in bytes."""
    out = {"rss": 0, "pss": 0, "uss": 0, "children_pss": 0, "children_uss": 0, "children": 0}
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        procs = [root]
    for proc in procs:
        try:
            info = proc.memory_full_info()
        except psutil.Error:
            continue
        out["rss"] += info.rss
        out["pss"] += getattr(info, "pss", 0)
        out["uss"] += info.uss
        if proc.pid != root.pid:
            out["children"] += 1
            out["children_pss"] += getattr(info, "pss", 0)
            out["children_uss"] += info.uss
    return out


class MemorySampler(threading.Thread):
    """Samples the tree every `interval` seconds into columns (t, rss, pss, ...), t in seconds
    since start(); `mark(name)` records a named moment with a sample of its own."""

    KEYS = ("rss", "pss", "uss", "children_pss", "children_uss", "children")

    def __init__(self, interval: float = INTERVAL_S) -> None:
        super().__init__(name="bench-memory-sampler", daemon=True)
        self.interval = interval
        self.columns: dict[str, list] = {"t": [], **{key: [] for key in self.KEYS}}
        self.marks: list[dict] = []
        self._root = psutil.Process()
        self._lock = threading.Lock()
        self._stop_event = threading.Event()
        self._t0 = time.perf_counter()

    def start(self) -> None:
        self._t0 = time.perf_counter()
        self.sample()
        super().start()

    def sample(self) -> dict:
        with self._lock:
            t = time.perf_counter() - self._t0
            values = tree_sample(self._root)
            self.columns["t"].append(round(t, 3))
            for key in self.KEYS:
                self.columns[key].append(values[key])
            return {"t": round(t, 3), **values}

    def mark(self, name: str, **extra: Any) -> dict:
        mark = {"name": name, **self.sample(), **extra}
        self.marks.append(mark)
        return mark

    def run(self) -> None:
        next_at = time.perf_counter()
        while True:
            # a fixed schedule (a late sample does not shift the next ones), but no burst of
            # catch-up samples after a long stall
            next_at = max(next_at + self.interval, time.perf_counter())
            if self._stop_event.wait(max(0.0, next_at - time.perf_counter())):
                return
            self.sample()

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


def epoch_indices(total: int, count: int, epoch: int, seed: int = 0) -> list[int]:
    """The epoch's random subset of the big list (the same for every loader)."""
    import numpy as np

    return np.random.default_rng([seed, epoch]).choice(total, size=min(count, total), replace=False).tolist()


def big_list(items: list[tuple[str, int]], total: int) -> list[tuple[str, int]]:
    """`total` (path, label) tuples cycling over `items`, each tuple and path string an object of
    its own (an f-string makes a new string), as a listing of that many files would be."""
    parts = [(*os.path.split(path), label) for path, label in items]
    return [(f"{folder}/{name}", label) for folder, name, label in (parts[i % len(parts)] for i in range(total))]


class EpochView:
    """asyncload's source over the big list: position i of epoch e is the list's item
    epoch_indices(...)[i]; the list itself stays whole in the view (and in this process)."""

    def __init__(self, items: list, count: int) -> None:
        self.items = items
        self.count = min(count, len(items))
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        self.index = epoch_indices(len(self.items), self.count, epoch)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int):
        return self.items[self.index[i]]


def label_sample(item: tuple[str, int]):
    """The `listonly` sample: the item's path length and label, no file read, so that an epoch
    over every item of the list takes seconds."""
    import numpy as np

    path, label = item
    return np.array([len(path)], np.int32), np.array(label, np.int64)


class ListOnlyDataset:
    """DataLoader's Dataset over the whole big list, each sample `label_sample(item)`."""

    def __init__(self, items: list) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int):
        return label_sample(self.items[index])


def build_case(case: str, spec: dict, mark: Callable[[str], Any]):
    """The loader of a case: an object with set_epoch(e), __iter__ and close()."""
    from bench.harness.contenders import CONTENDERS, RunData
    from bench.harness.dataset import list_image_folder
    from bench.harness.workloads import workloads

    workload = next(w for w in workloads(quick=False) if w.name == "imagenet-local")
    root = Path(spec["root"])
    items, _ = list_image_folder(root)
    workload = type(workload)(**{**workload.to_dict(), "samples": len(items), "batch_size": spec["batch"]})
    if case == "gil-asyncload":  # processes=None switches to children: PSS before and after
        from asyncload import AsyncLoader
        from bench.processes import GilDecode, calibrate

        return AsyncLoader(list(range(GIL_SAMPLES)), batch_size=32, seed=0, read=False,
                           decode=GilDecode(calibrate(1.0))), GIL_SAMPLES
    if case.startswith("local-"):
        data = RunData(root=str(root), items=items)
        if case == "local-asyncload":
            return CONTENDERS["asyncload"].build(workload, {"tag": "default"}, data), len(items)
        return CONTENDERS["DataLoader"].build(workload, {"num_workers": 2, "prefetch_factor": 2}, data), len(items)
    mark("building the list")
    listed = big_list(items, spec["items"])
    mark("list built")
    if case == "listonly-asyncload":  # read=False: the item itself goes to decode
        from asyncload import AsyncLoader

        return AsyncLoader(listed, batch_size=spec["batch"], shuffle=True, seed=0, read=False,
                           decode=label_sample), len(listed)
    if case == "listonly-dataloader":
        from bench.harness.contenders.dataloader import _Loader

        return _Loader(ListOnlyDataset(listed), spec["batch"], num_workers=2, prefetch_factor=2,
                       persistent_workers=True), len(listed)
    if case == "biglist-asyncload":
        from asyncload import AsyncLoader
        from bench.harness import tasks

        view = EpochView(listed, spec["epoch_samples"])
        loader = AsyncLoader(view, batch_size=spec["batch"], shuffle=True, seed=0, decode=tasks.image_decoder())
        original = loader.set_epoch

        def set_epoch(epoch: int) -> None:
            view.set_epoch(epoch)
            original(epoch)

        loader.set_epoch = set_epoch
        return loader, view.count
    return BigListDataLoader(listed, spec["epoch_samples"], spec["batch"]), min(spec["epoch_samples"], len(listed))


class _SubsetSampler:
    """DataLoader's sampler for the big list: the epoch's subset, drawn in the main process."""

    def __init__(self, total: int, count: int) -> None:
        self.total, self.count, self.epoch = total, min(count, total), 0

    def __iter__(self):
        return iter(epoch_indices(self.total, self.count, self.epoch))

    def __len__(self) -> int:
        return self.count


class BigListDataLoader:
    """DataLoader(num_workers=2, fork) over a Dataset that holds the whole big list."""

    def __init__(self, items: list, count: int, batch: int) -> None:
        from torch.utils.data import DataLoader

        from bench.harness.contenders.dataloader import ImageDataset  # torch: imported only for this case

        self.sampler = _SubsetSampler(len(items), count)
        self.loader = DataLoader(ImageDataset(items, None), batch_size=batch, sampler=self.sampler,
                                 num_workers=2, prefetch_factor=2, persistent_workers=True)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.epoch = epoch

    def __iter__(self):
        return iter(self.loader)

    def close(self) -> None:
        from bench.harness.contenders.dataloader import shut_down_workers

        shut_down_workers(self.loader)


def run_epochs(loader, epochs: int, sampler: MemorySampler, say: Callable[[str], None] = lambda line: None,
               label: str = "") -> list[dict]:
    """`epochs` passes (epoch 1 first, cold), each end marked on the sampler; returns per epoch
    its samples, wall time and rate."""
    from bench.harness.contenders import batch_size_of

    out = []
    for epoch in range(1, epochs + 1):
        loader.set_epoch(epoch)
        started = time.perf_counter()
        samples = 0
        for batch in loader:
            samples += batch_size_of(batch)
            del batch
            mark_switch(loader, sampler)
        wall = time.perf_counter() - started
        mark_switch(loader, sampler)  # a switch at the epoch's last batch
        mark = sampler.mark(f"epoch {epoch} end", epoch=epoch)
        out.append({"epoch": epoch, "samples": samples, "wall_s": round(wall, 3),
                    "samples_per_s": round(samples / wall, 1) if wall > 0 else None})
        say(f"    {label} | epoch {epoch}: {samples} samples in {wall:.2f} s, {samples / wall:,.0f} samples/s, "
            f"tree PSS {mark['pss'] / 2**20:,.0f} MiB, RSS {mark['rss'] / 2**20:,.0f} MiB")
    return out


def mark_switch(loader: Any, sampler: MemorySampler) -> None:
    """processes=None: a mark at its first batch in this process and at its first batch after
    each switch (the tree's PSS before and after the children)."""
    switch = getattr(loader, "_switch", None)
    if switch is None:
        return
    where = switch.backend.processes
    if getattr(loader, "_marked_where", None) != where:
        loader._marked_where = where
        sampler.mark("in this process" if not where else f"switched to {where} children", switch=where)


def summary(result: dict) -> dict:
    """Peak RSS/PSS over the run and PSS at each epoch's end, growth from epoch 1's end to the last's."""
    ends = [m for m in result["marks"] if m["name"].startswith("epoch ")]
    pss_end = [m["pss"] for m in ends]
    growth = 100 * (pss_end[-1] - pss_end[0]) / pss_end[0] if len(pss_end) > 1 and pss_end[0] else None
    named = {m["name"]: m for m in result["marks"]}
    listed = named["list built"]["uss"] - named["building the list"]["uss"] if "list built" in named else None
    return {"peak_rss": max(result["samples"]["rss"]), "peak_pss": max(result["samples"]["pss"]),
            "list_uss": listed,  # what building the big list added to this process's private memory
            "pss_epoch_end": pss_end, "children_pss_epoch_end": [m["children_pss"] for m in ends],
            "growth_1_to_last_pct": round(growth, 2) if growth is not None else None,
            "pss_at_switches": [(m["name"], m["pss"], m["children_pss"]) for m in result["marks"] if "switch" in m]}


def child(spec: dict) -> dict:
    """One case in this process, sampled from before its data exists to after its last epoch."""
    sampler = MemorySampler(spec["interval"])
    sampler.start()
    label = f"{spec['case']}: {LABELS.get(spec['case'], spec['case'])}"
    say = (lambda line: print(line, flush=True))
    try:
        loader, per_epoch = build_case(spec["case"], spec, sampler.mark)
        sampler.mark("loader built")
        epochs = run_epochs(loader, spec["epochs"], sampler, say, label)
        loader.close()
        sampler.mark("loader closed")
        time.sleep(spec["interval"])
    finally:
        sampler.stop()
    for number, epoch in enumerate(epochs, 1):
        if epoch["samples"] != per_epoch:
            raise RuntimeError(f"epoch {number} delivered {epoch['samples']} samples, expected {per_epoch}")
    result = {"case": spec["case"], "label": LABELS.get(spec["case"], spec["case"]), "ok": True,
              "interval_s": spec["interval"], "samples_per_epoch": per_epoch, "epochs": epochs,
              "samples": sampler.columns, "marks": sampler.marks}
    result.update(summary(result))
    return result


def run_case(spec: dict, timeout: float = 300) -> dict:
    """One case in a fresh `python -m bench.memory --child` process."""
    with tempfile.TemporaryDirectory(prefix="asyncload-memory-") as tmp:
        out = Path(tmp) / "result.json"
        proc = subprocess.run([sys.executable, "-m", "bench.memory", "--child", str(out)], input=json.dumps(spec),
                              check=False, text=True, cwd=ROOT, timeout=timeout, stderr=subprocess.PIPE)
        if not out.exists():
            tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
            return {"case": spec["case"], "ok": False, "error": f"exit code {proc.returncode}: {tail}"}
        return json.loads(out.read_text())


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def summary_line(row: dict) -> str:
    if not row.get("ok"):
        return f"{row['case']}: failed: {row.get('error')}"
    ends = ", ".join(mib(v) for v in row["pss_epoch_end"])
    workers = ", ".join(mib(v) for v in row["children_pss_epoch_end"])
    workers = f", its workers' PSS: {workers} MiB" if any(row["children_pss_epoch_end"]) else ""
    rates = ", ".join(f"{e['samples_per_s']:,.0f}" for e in row["epochs"])
    switches = "; ".join(f"{name}: PSS {mib(pss)} MiB (children {mib(children)})"
                         for name, pss, children in row.get("pss_at_switches", []))
    workers += f"; processes=None: {switches}" if switches else ""
    return (f"{row['case']} ({row['label']}): peak RSS {mib(row['peak_rss'])} MiB, peak PSS {mib(row['peak_pss'])} MiB, "
            f"PSS at the end of epochs 1-{len(row['pss_epoch_end'])}: {ends} MiB, growth 1->{len(row['pss_epoch_end'])}: "
            f"{row['growth_1_to_last_pct']:+.1f} %{workers} (samples/s per epoch: {rates})")


def plot(results: dict, path: Path) -> None:
    """One panel per workload: each contender's tree PSS (solid), RSS (dashed) and its workers'
    PSS (dotted), epoch ends as vertical lines in the contender's colour; one legend below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    rows = [r for r in results["cases"] if r.get("ok")]
    workloads = list(dict.fromkeys(r["case"].split("-")[0] for r in rows))
    settings = results["settings"]
    titles = {"local": f"{settings['local_images']:,} local JPEGs, all of them each epoch",
              "biglist": f"a list of {settings['items']:,} (path, label) items, "
                         f"{settings['epoch_samples']:,} random ones per epoch",
              "listonly": f"the same list, all {settings['items']:,} items each epoch, "
                          f"no file read"}
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.5 * len(workloads), 5), squeeze=False)
    colours = {"asyncload": "tab:blue", "dataloader": "tab:red"}
    for ax, workload in zip(axes[0], workloads):
        growth = []
        for row in (r for r in rows if r["case"].startswith(workload + "-")):
            colour = colours.get(row["case"].split("-")[1], "tab:gray")
            s = row["samples"]
            ax.plot(s["t"], [v / 2**20 for v in s["pss"]], color=colour, lw=1.8)
            ax.plot(s["t"], [v / 2**20 for v in s["rss"]], color=colour, lw=1, ls="--")
            if any(s["children"]):
                ax.plot(s["t"], [v / 2**20 for v in s["children_pss"]], color=colour, lw=1, ls=":")
            for mark in row["marks"]:
                if mark["name"].startswith("epoch "):
                    ax.axvline(mark["t"], color=colour, lw=0.8, alpha=0.5)
                    ax.annotate(mark["name"].replace(" end", ""), (mark["t"], 1), xycoords=ax.get_xaxis_transform(),
                                xytext=(-9, -4), textcoords="offset points", fontsize=7, color=colour,
                                rotation=90, va="top")
            growth.append((row["label"].split(" ")[0], row["growth_1_to_last_pct"]))
        change = ", ".join(f"{name} {pct:+.1f} %" for name, pct in growth)
        ax.set_title(f"{titles.get(workload, workload)}\nPSS from the end of epoch 1 to the last: {change}",
                     fontsize=9)
        ax.set_xlabel("seconds since the case's process started", fontsize=8)
        ax.set_ylabel("MiB, process + children")
        ax.set_ylim(0, ax.get_ylim()[1] * 1.15)
        ax.grid(alpha=0.3)
    handles = [Line2D([], [], color="tab:blue", lw=2, label="asyncload (defaults)"),
               Line2D([], [], color="tab:red", lw=2, label="DataLoader num_workers=2 (fork)"),
               Line2D([], [], color="black", lw=1.8, label="PSS, process + children"),
               Line2D([], [], color="black", lw=1, ls="--", label="RSS, process + children"),
               Line2D([], [], color="black", lw=1, ls=":", label="PSS of the workers alone"),
               Line2D([], [], color="gray", lw=0.8, alpha=0.6, label="end of each epoch")]
    fig.legend(handles=handles, loc="lower center", ncol=6, fontsize=8, frameon=False)
    fig.suptitle(f"Memory over a run, {results['machine']['cpu']} ({results['machine']['usable_cores']} cores), "
                 f"{results['created'][:16].replace('T', ' ')} UTC, sampled every {settings['interval_s']} s",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--items", type=int, default=ITEMS, help="length of the big list")
    parser.add_argument("--epoch-samples", type=int, default=EPOCH_SAMPLES, help="big list: samples per epoch")
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--interval", type=float, default=INTERVAL_S, help="seconds between samples")
    parser.add_argument("--root", type=Path, default=None,
                        help="image folder (default: the bench's 2,048 JPEGs, generated once)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--plot", type=Path, default=None, metavar="JSON",
                        help="only draw the PNG of an earlier run's JSON (beside it)")
    parser.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child is not None:  # one case, the spec on stdin, the result to the given file
        args.child.write_text(json.dumps(child(json.load(sys.stdin))))
        sys.stdout.flush()
        os._exit(0)  # do not wait on a contender's stuck non-daemon threads
    if args.plot is not None:
        plot(json.loads(args.plot.read_text()), args.plot.with_suffix(".png"))
        return
    from bench.harness.machine import machine_info, machine_slug, versions

    if args.root is None:
        from bench.harness.dataset import ensure_image_set
        from bench.harness.workloads import image_set

        args.root = ensure_image_set(image_set(quick=False))
    machine = machine_info()
    now = dt.datetime.now(dt.timezone.utc)
    from bench.harness.dataset import list_image_folder

    results = {"created": now.isoformat(timespec="seconds"), "machine": machine, "versions": versions(),
               "command": "python -m bench.memory " + " ".join(sys.argv[1:] if argv is None else argv),
               "load_average_before": [round(v, 2) for v in os.getloadavg()],
               "settings": {"items": args.items, "epoch_samples": args.epoch_samples, "epochs": args.epochs,
                            "batch": args.batch, "interval_s": args.interval,
                            "local_images": len(list_image_folder(args.root)[0])},
               "cases": []}
    print(f"memory over a run: {machine['cpu']}, {machine['usable_cores']} cores, load average "
          f"{results['load_average_before']}", flush=True)
    started = time.perf_counter()
    for case in args.cases:
        spec = {"case": case, "root": str(args.root), "items": args.items, "epoch_samples": args.epoch_samples,
                "epochs": args.epochs, "batch": args.batch, "interval": args.interval}
        row = run_case(spec)
        results["cases"].append(row)
        print(f"[{time.perf_counter() - started:.0f} s] {summary_line(row)}", flush=True)
    results["load_average_after"] = [round(v, 2) for v in os.getloadavg()]
    results["wall_s"] = round(time.perf_counter() - started, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"{machine_slug(machine)}-{now:%Y-%m-%d}-memory"
    stem.with_suffix(".json").write_text(json.dumps(results, indent=1))
    plot(results, stem.with_suffix(".png"))
    print(f"load average after: {results['load_average_after']}; {results['wall_s']:.0f} s; "
          f"wrote {stem}.json and .png", flush=True)
    for row in results["cases"]:
        print(summary_line(row), flush=True)


if __name__ == "__main__":
    main()
