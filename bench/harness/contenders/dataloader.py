"""torch.utils.data.DataLoader with worker processes: the baseline everything is compared with."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from bench.harness import tasks
from bench.harness.contenders.base import Contender, RunData, cores
from bench.harness.workloads import Workload


class ImageDataset(Dataset):
    """(url, label) items -> (uint8 HxWx3 array, label), via the shared read and ImageDecoder."""

    def __init__(self, items: list[tuple[str, int]], storage_options: dict | None) -> None:
        self.items = items
        self.storage_options = storage_options

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int):
        return tasks.load_image(self.items[index], self.storage_options)


class LargeDataset(Dataset):
    """Index -> 3.125 ms of I/O, then a fresh (1000, 150) float64 array."""

    def __init__(self, samples: int) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int):
        return tasks.load_large(index)


def shut_down_workers(loader: DataLoader) -> None:
    """Ends a DataLoader's persistent workers now (DataLoader has no public close)."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
    loader._iterator = None


class _Loader:
    """A DataLoader whose shuffle follows set_epoch, and whose workers close() shuts down."""

    def __init__(self, dataset: Dataset, batch_size: int, **kwargs: Any) -> None:
        self.generator = torch.Generator()
        self.loader = DataLoader(dataset, batch_size=batch_size, shuffle=True,
                                 generator=self.generator, **kwargs)

    def set_epoch(self, epoch: int) -> None:
        self.generator.manual_seed(epoch)

    def __iter__(self):
        return iter(self.loader)

    def close(self) -> None:
        shut_down_workers(self.loader)


class DataLoaderContender(Contender):
    name = "DataLoader"
    baseline = True

    def configs(self, workload: Workload, quick: bool) -> list[dict]:
        """num_workers 0..2x cores, prefetch_factor 2 and 4 where there are workers; a reduced
        sweep in quick mode and for the consumer-bound workload. From S3, 0 and 1 workers are
        left out: each reads one object at a time (a quarter of 4 workers' rate, never best) and
        takes a minute of the run behind latency; prefetch_factor 4 is tried at 2x cores only."""
        n, top = cores(), 2 * cores()
        if workload.name == "python-step":  # workers as processes, against asyncload's one child
            return [{"num_workers": w, "prefetch_factor": 2} for w in ((n,) if quick else (n, top))]
        if workload.name == "consumer-bound" or quick:
            # Quick mode leaves out num_workers=0 where I/O waits dominate (S3, large samples):
            # one serial reader there takes longer than the rest of the sweep and is never best.
            workers = [w for w in sorted({0, n, top}) if w or not (quick and workload.source != "local")]
            factors: dict[int, tuple] = {w: (2,) for w in workers}
        else:
            s3 = workload.source.startswith("s3")
            workers = list(range(2 if s3 else 0, top + 1))
            factors = {w: (2, 4) if w == top or (w == n and not s3) else (2,) for w in workers}
        return [{"num_workers": w, "prefetch_factor": pf} if w else {"num_workers": 0}
                for w in workers for pf in (factors[w] if w else (None,))]

    def series(self, config: dict) -> str:
        """num_workers=0 has no prefetch factor; it starts the pf=2 line."""
        return f"{self.name} prefetch_factor={config.get('prefetch_factor') or 2}"

    def build(self, workload: Workload, config: dict, data: RunData) -> Any:
        workers = config["num_workers"]
        if workload.source == "synthetic":
            dataset: Dataset = LargeDataset(workload.samples)
        else:
            dataset = ImageDataset(data.items, data.storage_options)
        kwargs: dict[str, Any] = {"num_workers": workers,
                                  "pin_memory": torch.cuda.is_available()}
        if workers:
            kwargs.update(prefetch_factor=config["prefetch_factor"], persistent_workers=True)
        return _Loader(dataset, workload.batch_size, **kwargs)
