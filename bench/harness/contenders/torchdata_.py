"""torchdata.nodes with ParallelMapper(method="thread"): PyTorch's own thread-based pipeline."""

from __future__ import annotations

from typing import Any

import torch

from bench.harness import tasks
from bench.harness.contenders.base import Contender, RunData, cores
from bench.harness.workloads import Workload


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
    skipped = ("python-step",)

    def unavailable(self) -> str | None:
        try:
            from torchdata.nodes import ParallelMapper  # noqa: F401
        except Exception as error:  # noqa: BLE001
            return f"{type(error).__name__}: {error}"
        return None

    def configs(self, workload: Workload, quick: bool) -> list[dict]:
        """One thread count, its best in every earlier full run (which swept 1x, 2x cores and
        16): 2x cores to decode local files, 16 where reads wait (S3, large samples)."""
        threads = 2 * cores() if workload.source == "local" else 16
        return [{"num_workers": threads}]

    def build(self, workload: Workload, config: dict, data: RunData) -> Any:
        return _Loader(workload, config, data)
