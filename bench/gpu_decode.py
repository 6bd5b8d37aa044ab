"""The GPU decode stage against the CPU path and ``DataLoader``: ImageNet-like JPEGs on local disk,
``train=True`` 224 crops, batches to the GPU, with and without a ResNet-18 training step.

    python -m bench.gpu_decode [--samples 16384] [--rounds 3] [--batch-size 256] [--workers 16]
                               [--no-model | --model-only] [--out bench/results/NAME.json]
    bash bench/gpu16.sh        # on a lent 16-core GPU box: the CUDA tests and both halves, ~8 minutes
    python -m bench.gpu_decode --quick     # on any machine: a check of this code, not a measurement

Contenders (each ``ImageDecoder(224, train=True)``'s transform, the batch on the GPU):
- ``default``: ``AsyncLoader(device="cuda")``: the GPU decode stage, its split measured (``"auto"``);
- ``CPU only``: ``gpu_decode=False`` (the default before the stage);
- ``GPU only``: ``gpu_decode=True``;
- ``DataLoader(W)``: ``W`` workers decoding with the same code (``bench.harness``'s ImageDataset),
  ``pin_memory``, a non-blocking copy.
Every loader normalises on the GPU (asyncload's ``normalize=``, the DataLoader's batch after its
copy). With the model, each batch also runs a ResNet-18 step (torchvision's where it imports,
else a small conv net; bf16 autocast, channels_last, SGD). Loaders are built once and warmed up
for an epoch; rounds rotate their order so drift spreads over all. Prints each round, the
medians, the ratios to the DataLoader and the default's split (``stats.report()``'s line), and
writes them as JSON (default: ``bench/results/<machine>-<date>-gpu-decode.json``).

Without CUDA (``--quick`` or not) the stage runs through nvImageCodec's CPU backend
(``GpuImageDecoder(device="cpu")``) into host memory and the model on the CPU: the same code
paths, figures that say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from asyncload import AsyncLoader, ImageDecoder
from asyncload.device import normalize_images
from bench.harness.contenders.dataloader import ImageDataset
from bench.harness.dataset import ensure_image_set, list_image_folder
from bench.harness.machine import cpu_model
from bench.harness.workloads import image_set

RESULTS = Path(__file__).resolve().parent / "results"
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def model_step(cuda: bool) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """One training step on a float NCHW batch: ResNet-18 (or a small conv net without
    torchvision), channels_last, bf16 autocast on CUDA."""
    device = "cuda" if cuda else "cpu"
    try:
        from torchvision.models import resnet18

        net = resnet18(num_classes=1000)
    except Exception:  # torchvision absent, or built for another torch
        net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 32, 7, stride=4, padding=3), torch.nn.ReLU(),
            torch.nn.Conv2d(32, 64, 3, stride=2, padding=1), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 1000))
    net = net.to(device, memory_format=torch.channels_last)
    optimiser = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(images: torch.Tensor, labels: torch.Tensor) -> None:
        with torch.autocast(device, dtype=torch.bfloat16, enabled=cuda):
            loss = loss_fn(net(images.contiguous(memory_format=torch.channels_last)), labels % 1000)
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()

    step.name = type(net).__name__ if not isinstance(net, torch.nn.Sequential) else "small conv net"
    return step


def run_epoch(loader: Any, number: int, cuda: bool, step: Callable | None) -> float:
    """Samples/s of one epoch counted from its first batch (so a loader's start is not in it)."""
    if isinstance(loader, AsyncLoader):
        loader.set_epoch(number)
    batches = iter(loader)
    next(batches)
    first, count = time.perf_counter(), 0
    for images, labels in batches:
        if not isinstance(loader, AsyncLoader):  # the DataLoader's batch: copy up, normalise there
            images = images.to("cuda" if cuda else "cpu", non_blocking=True)
            labels = labels.to(images.device, non_blocking=True)
            images = normalize_images(images, MEAN, STD)
        if step is not None:
            step(images, labels)
        count += len(labels)
    if cuda:
        torch.cuda.synchronize()
    return count / (time.perf_counter() - first)


def contenders(items: list, batch_size: int, workers: int, cuda: bool) -> dict[str, Callable[[], Any]]:
    common = dict(batch_size=batch_size, seed=0, normalize=(MEAN, STD))
    if cuda:
        def asyncload(gpu_decode: bool | str) -> AsyncLoader:
            return AsyncLoader(items, decode=ImageDecoder(224, train=True), device="cuda", gpu_decode=gpu_decode,
                               **common)
    else:  # the stage through nvImageCodec's CPU backend, into host memory
        from asyncload.decode.gpu import GpuImageDecoder

        def asyncload(gpu_decode: bool | str) -> AsyncLoader:
            decode = (ImageDecoder(224, train=True) if gpu_decode is False else
                      GpuImageDecoder(224, train=True, device="cpu", split="gpu" if gpu_decode is True else "auto"))
            return AsyncLoader(items, decode=decode, **common)
    return {
        "default": lambda: asyncload("auto"),
        "CPU only": lambda: asyncload(False),
        "GPU only": lambda: asyncload(True),
        f"DataLoader({workers})": lambda: torch.utils.data.DataLoader(
            ImageDataset(items, None), batch_size=batch_size, shuffle=True, num_workers=workers, pin_memory=cuda,
            persistent_workers=True, prefetch_factor=4),
    }


def measure(makers: dict[str, Callable[[], Any]], rounds: int, cuda: bool, step: Callable | None,
            label: str) -> tuple[dict[str, list[float]], str | None, str]:
    """Each contender's samples/s per round (built once, warmed up one epoch), the default's
    split line and its whole ``stats.report()`` (the fallbacks by reason among it)."""
    loaders = {name: make() for name, make in makers.items()}
    rates: dict[str, list[float]] = {name: [] for name in loaders}
    try:
        for name, loader in loaders.items():
            print(f"{label}: built {name}, warm-up {run_epoch(loader, 0, cuda, step):,.0f}/s", flush=True)
        for number in range(1, rounds + 1):
            names = list(loaders)
            names = names[number % len(names):] + names[:number % len(names)]
            for name in names:
                rates[name].append(run_epoch(loaders[name], number, cuda, step))
            print(f"{label} round {number}: " + ", ".join(f"{n} {v[-1]:,.0f}/s" for n, v in rates.items()), flush=True)
        split = loaders["default"].stats.gpu_decode_choice
        report = loaders["default"].stats.report()
    finally:
        for loader in loaders.values():
            if isinstance(loader, AsyncLoader):
                loader.close()
    return rates, split, report


def summary(rates: dict[str, list[float]], label: str) -> dict[str, Any]:
    median = {name: statistics.median(values) for name, values in rates.items()}
    dataloader = next(value for name, value in median.items() if name.startswith("DataLoader"))
    for name, value in median.items():
        print(f"{label} {name:>16}: {value:9,.0f} img/s  {value / dataloader:.2f}x DataLoader")
    return {name: {"rounds": rates[name], "median": value, "vs_dataloader": value / dataloader}
            for name, value in median.items()}


def default_out(machine: str) -> Path:
    slug = re.sub(r"[^a-z0-9]+", "-", machine.lower()).strip("-")[:40]
    return RESULTS / f"{slug}-{datetime.date.today().isoformat()}-gpu-decode.json"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few batches of the small set: checks the code")
    parser.add_argument("--samples", type=int, default=None, help="samples an epoch (the image set repeated)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--workers", type=int, default=None, help="the DataLoader's workers (default: the cores)")
    parser.add_argument("--no-model", action="store_true", help="skip the runs with a ResNet-18 step")
    parser.add_argument("--model-only", action="store_true", help="only the runs with a ResNet-18 step")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    cores = len(os.sched_getaffinity(0))
    samples = args.samples or (64 if args.quick else 16384)
    rounds = args.rounds or (1 if args.quick else 3)
    batch_size = args.batch_size or (16 if args.quick else 256)
    workers = args.workers or (2 if args.quick else cores)
    items, _ = list_image_folder(ensure_image_set(image_set(quick=args.quick)))
    items = (items * (samples // len(items) + 1))[:samples]
    gpu = torch.cuda.get_device_name(0) if cuda else "no GPU (nvImageCodec's CPU backend)"
    machine = f"{cpu_model()}, {cores} cores, {gpu}"
    print(f"machine: {machine}; {samples} samples an epoch, batches of {batch_size}", flush=True)
    makers = contenders(items, batch_size, workers, cuda)
    results: dict[str, Any] = {"machine": machine, "date": datetime.date.today().isoformat(),
                               "samples": samples, "batch_size": batch_size, "rounds": rounds, "cuda": cuda}
    if args.no_model and args.model_only:
        parser.error("--no-model and --model-only leave nothing to measure")
    if not args.model_only:
        rates, split, report = measure(makers, rounds, cuda, None, "no model")
        results["no_model"] = {"img_s": summary(rates, "no model"), "default_split": split, "default_report": report}
        print(f"no model, the default's split: {split}")
    if not args.no_model:
        step = model_step(cuda)
        rates, split, report = measure(makers, rounds, cuda, step, step.name)
        results["model"] = {"name": step.name, "img_s": summary(rates, step.name), "default_split": split,
                            "default_report": report}
        print(f"{step.name}, the default's split: {split}")
    out = args.out or default_out(machine)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
