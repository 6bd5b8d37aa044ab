"""The default (``processes=None``) against ``DataLoader`` with a worker per core and against every
hand-set ``processes=N``, on native JPEG decode + resize of the local image set, at whatever core
count this machine has: the figure the measuring default must earn on a 16-core GPU node
(>= 1.3x the DataLoader, within 10 % of the best hand-set count).

    python -m bench.cores [--samples 16384] [--rounds 3] [--counts 2,4,8,16] [--batch-size 256]

Every contender decodes the same way (``bench.harness.tasks``: ``ImageDecoder(224, train=True)``,
the simplejpeg + OpenCV path; the DataLoader reads with ``ImageDataset``, as in ``python -m
bench``) and, on a CUDA machine, hands batches to the GPU (asyncload with ``device="cuda"``, the
DataLoader with ``pin_memory`` and a non-blocking copy). The pinned loaders are built once and
warmed up; the default is built afresh every round (its measuring and its switch count) and runs
two epochs: the first from its first batch, the second settled. Rounds rotate the order so the
machine's drift spreads over all of them. Prints each round, the medians and the ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any, Callable

import torch

from asyncload import AsyncLoader
from bench.harness.contenders.dataloader import ImageDataset
from bench.harness.dataset import ensure_image_set, list_image_folder
from bench.harness.machine import cpu_model
from bench.harness.tasks import image_decoder
from bench.harness.workloads import image_set

CORES = len(os.sched_getaffinity(0))


def run_epoch(loader: Any, number: int, cuda: bool) -> tuple[float, float]:
    """Samples/s of one epoch counted from its first batch, and the time to that batch."""
    if isinstance(loader, AsyncLoader):
        loader.set_epoch(number)  # the DataLoader's RandomSampler draws a new order each pass itself
    started = time.perf_counter()
    batches = iter(loader)
    images, _ = next(batches)
    first = time.perf_counter()
    count = 0
    for images, labels in batches:
        if cuda and not images.is_cuda:
            images = images.cuda(non_blocking=True)
        count += len(labels)
    if cuda:
        torch.cuda.synchronize()
    return count / (time.perf_counter() - first), first - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=16384, help="samples an epoch (the image set repeated)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--counts", default=",".join(str(n) for n in (2, 4, 8, 16, 32) if n <= CORES),
                        help="hand-set processes=N to compare (processes=0 always runs)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    items, _ = list_image_folder(ensure_image_set(image_set(quick=False)))
    items = (items * (args.samples // len(items) + 1))[:args.samples]
    decode = image_decoder()  # the one every contender of python -m bench decodes with
    device = {"device": "cuda"} if cuda else {}
    print(f"machine: {cpu_model()}, {CORES} usable cores, "
          f"{torch.cuda.get_device_name(0) if cuda else 'no GPU'}; {args.samples} samples an epoch, "
          f"batches of {args.batch_size}", flush=True)

    def asyncload(processes: int | None) -> AsyncLoader:
        # hand-set counts are the CPU pipelines (processes=0 too: no GPU decode stage); the default is the default
        stage = {} if processes is None else {"gpu_decode": False}
        return AsyncLoader(items, batch_size=args.batch_size, seed=0, decode=decode, processes=processes, **device,
                           **stage)

    pinned: dict[str, Callable[[], Any]] = {"processes=0": lambda: asyncload(0)}
    pinned.update({f"processes={n}": (lambda n=n: asyncload(n)) for n in map(int, args.counts.split(",")) if n})
    pinned[f"DataLoader({CORES})"] = lambda: torch.utils.data.DataLoader(
        ImageDataset(items, None), batch_size=args.batch_size, shuffle=True, num_workers=CORES, pin_memory=cuda,
        persistent_workers=True, prefetch_factor=4)
    loaders = {}
    for name, make in pinned.items():
        loaders[name] = make()
        rate, first = run_epoch(loaders[name], 0, cuda)
        print(f"built {name}: first batch {first:.2f} s, warm-up epoch {rate:.0f}/s", flush=True)
    rates: dict[str, list[float]] = {name: [] for name in [*loaders, "default, 1st epoch", "default, 2nd epoch"]}
    try:
        for number in range(1, args.rounds + 1):
            names = [*loaders, "default"]
            names = names[number % len(names):] + names[:number % len(names)]
            for name in names:
                if name != "default":
                    rates[name].append(run_epoch(loaders[name], number, cuda)[0])
                    continue
                with asyncload(None) as fresh:
                    rate, first = run_epoch(fresh, number, cuda)
                    rates["default, 1st epoch"].append(rate)
                    rates["default, 2nd epoch"].append(run_epoch(fresh, number + 100, cuda)[0])
                    chose, report = fresh.stats.processes_choice, fresh.stats.report()
            print(f"round {number}: " + ", ".join(f"{name} {values[-1]:.0f}/s" for name, values in rates.items())
                  + f"; the default's first batch {first:.2f} s, it chose: {chose}", flush=True)
    finally:
        for loader in loaders.values():
            if isinstance(loader, AsyncLoader):
                loader.close()
    print("the default's last report:\n" + report)
    median = {name: statistics.median(values) for name, values in rates.items()}
    dataloader = median[f"DataLoader({CORES})"]
    best = max((name for name in median if name.startswith("processes=")), key=median.__getitem__)
    for name, value in median.items():
        print(f"{name:>22}: {value:7.0f}/s  {value / dataloader:.2f}x DataLoader({CORES})")
    for epoch in ("1st", "2nd"):
        value = median[f"default, {epoch} epoch"]
        print(f"the default's {epoch} epoch: {value / dataloader:.2f}x DataLoader({CORES}), "
              f"{value / median[best]:.2f}x the best hand-set ({best})")


if __name__ == "__main__":
    main()
