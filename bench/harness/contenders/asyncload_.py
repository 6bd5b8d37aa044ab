"""asyncload: one event loop for reads, a thread pool of GIL-free decoders, in-place batches."""

from __future__ import annotations

from typing import Any

from bench.harness import tasks
from bench.harness.contenders.base import Contender, RunData, cores
from bench.harness.workloads import Workload


class AsyncLoadContender(Contender):
    name = "asyncload"

    @property
    def defaults(self) -> dict:  # AsyncLoader's own defaults
        return {"num_threads": cores(), "io_concurrency": 64}

    def unavailable(self) -> str | None:
        try:
            from asyncload import AsyncLoader, ImageDecoder, image_folder  # noqa: F401
        except Exception as error:  # noqa: BLE001 - any failure is the reason to report
            return f"{type(error).__name__}: {error}"
        return None

    def configs(self, workload: Workload, quick: bool) -> list[dict]:
        """Defaults first, then the tuned sweep: decode threads at the core count and around it,
        I/O concurrency below and above the default of 64 (not for local files: decode threads
        read those themselves), and for S3 s3fs (``client="fsspec"``) against the default
        obstore, where obstore is installed."""
        n = cores()
        default = {"tag": "default"}
        auto = {"tag": "auto", "num_threads": "auto", "io_concurrency": "auto"}
        if workload.name == "consumer-bound":
            return [default] if quick else [default, auto]
        if workload.samples_per_shard:  # a handful of ranged reads (4 at once by default)
            tuned = [{"tag": "tuned", "num_threads": 2 * n}, {"tag": "tuned", "num_threads": n, "io_concurrency": 8}]
            return [default] if quick else [default, *tuned, auto]
        if workload.name == "python-step":  # the same pipeline, in-process and in child processes
            return [default, {"processes": 1}, {"processes": 2}]
        if quick:  # the defaults (and s3fs from S3) only: a setup check in under 3 minutes
            sweep = []
        else:
            sweep = [{"num_threads": t, "io_concurrency": 64} for t in (1, 2 * n) if t != n]
            if workload.source != "local":
                sweep += [{"num_threads": n, "io_concurrency": c} for c in (16, 256)]
            if workload.source == "local":  # beside DataLoader's num_workers: N pipelines, N GILs
                sweep += [{"processes": p} for p in (1, 2)]
        if workload.source == "synthetic" and not quick:  # the same wait as a plain function
            sweep.append({"num_threads": n, "io_concurrency": 64, "read": "sync"})
        if workload.source.startswith("s3") and _has_obstore():
            sweep.append({"num_threads": n, "io_concurrency": 64, "client": "fsspec"})
        configs = [default] + [{"tag": "tuned", **c} for c in sweep]
        if workload.name == "train" and _has_nvjpeg():  # GpuImageDecoder: a batch per call on the GPU
            configs.append({"tag": "gpu-decode", "decode": "gpu"})
        if not quick:  # asyncload's own autotuner
            configs.append(auto)
        return configs

    def supports(self, workload: Workload) -> bool:
        return True

    def sweep_value(self, config: dict) -> int | None:
        value = super().sweep_value(config)
        return value if isinstance(value, int) else None  # "auto" has no place on the x axis

    def build(self, workload: Workload, config: dict, data: RunData) -> Any:
        from asyncload import AsyncLoader, image_folder, tar_shards

        settings = {k: config[k] for k in ("num_threads", "io_concurrency", "prefetch", "processes") if k in config}
        device = "cuda" if data.device == "cuda" else None
        if workload.source == "synthetic":
            read = tasks.large_read_sync if config.get("read") == "sync" else tasks.large_read_async
            return AsyncLoader(list(range(workload.samples)), batch_size=workload.batch_size,
                               shuffle=True, seed=0, read=read, decode=tasks.large_array,
                               device=device, **settings)
        storage_options = data.storage_options
        if "client" in config:  # "fsspec": s3fs rather than the default obstore
            storage_options = {**storage_options, "client": config["client"]}
        if workload.samples_per_shard:
            source = tar_shards(data.root, storage_options=storage_options, shuffle_buffer=2 * workload.batch_size)
        else:
            source = image_folder(data.root, storage_options=storage_options)
        if len(source) != len(data.items):
            raise RuntimeError(f"the source has {len(source)} items, the bench listed {len(data.items)}")
        decode = tasks.image_decoder()
        if config.get("decode") == "gpu":
            from asyncload import GpuImageDecoder

            decode = GpuImageDecoder(224, train=True, seed=0, device=device, split="gpu")
        return AsyncLoader(source, batch_size=workload.batch_size, shuffle=True, seed=0,
                           decode=decode, storage_options=storage_options,
                           device=device, **settings)


def _has_nvjpeg() -> bool:
    """A GPU and nvImageCodec (``asyncload[gpu]``): without both, "gpu-decode" would only measure
    its CPU fallback."""
    import torch

    if not torch.cuda.is_available():
        return False
    from asyncload.decode.nvimgcodec import available

    return available()


def _has_obstore() -> bool:
    try:
        import obstore.fsspec  # noqa: F401
    except ImportError:
        return False
    return True
