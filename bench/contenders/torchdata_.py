"""torchdata.nodes with ParallelMapper(method="thread"): PyTorch's own thread-based pipeline."""

from __future__ import annotations

from typing import Any

import torch

from bench import tasks
from bench.contenders.base import Contender, RunData, cores
from bench.workloads import Workload


class _Loader:
    """Sampler -> threaded map of the shared per-sample function -> batch -> collate -> prefetch."""

    def __init__(self, workload: Workload, config: dict, data: RunData) -> None:
        from torch.utils.data import RandomSampler, default_collate
        from torchdata import nodes

        self.generator = torch.Generator()
        if workload.source == "synthetic":
            size, fn = workload.samples, tasks.load_large
        else:
            items, options = data.items, data.storage_options
            size = len(items)
            fn = lambda i: tasks.load_image(items[i], options)  # noqa: E731
        sampler = RandomSampler(range(size), generator=self.generator)
        node = nodes.SamplerWrapper(sampler)
        node = nodes.ParallelMapper(node, map_fn=fn, num_workers=config["num_workers"],
                                    method="thread", in_order=True)
        node = nodes.Batcher(node, batch_size=workload.batch_size, drop_last=False)
        node = nodes.Mapper(node, default_collate)
        if torch.cuda.is_available():
            node = nodes.PinMemory(node)
        node = nodes.Prefetcher(node, prefetch_factor=config.get("prefetch", 2))
        self.loader = nodes.Loader(node)

    def set_epoch(self, epoch: int) -> None:
        self.generator.manual_seed(epoch)

    def __iter__(self):
        return iter(self.loader)

    def close(self) -> None:
        pass


class TorchDataContender(Contender):
    name = "torchdata.nodes"

    def unavailable(self) -> str | None:
        try:
            from torchdata.nodes import ParallelMapper  # noqa: F401
        except Exception as error:  # noqa: BLE001
            return f"{type(error).__name__}: {error}"
        return None

    def configs(self, workload: Workload, quick: bool) -> list[dict]:
        """Thread counts from the core count up: I/O-bound samples want many more threads (from
        S3, so many that the core count is left out); decoding local files, 16 cannot help."""
        n = cores()
        if workload.name in ("consumer-bound", "python-step"):
            return [{"num_workers": 2 * n}]
        if quick:
            threads = (2 * n,) if workload.source == "local" else (16,)
        elif workload.source.startswith("s3"):
            threads = (2 * n, 16)
        elif workload.source == "local":
            threads = (n, 2 * n)
        else:
            threads = (n, 2 * n, 16)
        return [{"num_workers": t} for t in threads]

    def build(self, workload: Workload, config: dict, data: RunData) -> Any:
        return _Loader(workload, config, data)
