"""Hugging Face Accelerate on CPU as its docs show it, for ``tests/test_trainers.py``; run on 2
processes (gloo) by Accelerate's own launcher for tests on the CPU, ``debug_launcher``:

    python tests/accelerate_run.py OUT

It forks the ranks from this process, which has imported torch and Accelerate once: under
torchrun a launcher and two fresh interpreters would import torch three times (about 2 s of CPU
each on a 2-core box). The docs' ``torchrun`` run is ``docs/guides/accelerate.md``'s, which
``tests/test_readme.py`` runs as written.

Each rank writes ``OUT/rank<r>.json``: where gradient accumulation synced (batch numbers, per
epoch) with an ``AsyncLoader`` and with a prepared ``DataLoader`` of as many batches a rank;
what epoch 1 delivered before ``save_state`` and, in a new loader, after ``load_state``; and
what ``prepare`` and ``skip_first_batches`` did with the loader.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator, debug_launcher
from torch.utils.data import DataLoader

from asyncload import AsyncLoader

ITEMS, BATCH, STEPS = 64, 4, 3  # 8 batches a rank: a sync after batches 2, 5 and (the epoch's end) 7
SAVE_AFTER = 3  # batches of epoch 1 before save_state


def index_sample(i: int) -> np.ndarray:
    """A sample whose content is its index."""
    return np.full(2, i, np.float32)


def make_loader() -> AsyncLoader:
    return AsyncLoader(list(range(ITEMS)), batch_size=BATCH, shuffle=True, seed=11, read=False,
                       decode=index_sample, num_threads=1)


def syncs(accelerator: Accelerator, model: torch.nn.Module, optimizer, loader, epochs: int = 2) -> list[list[int]]:
    """The batch numbers after which accumulation synced, per epoch (the docs' loop)."""
    found = []
    for epoch in range(epochs):
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        synced = []
        for number, batch in enumerate(loader):
            batch = batch[0] if isinstance(batch, (list, tuple)) else batch
            with accelerator.accumulate(model):
                accelerator.backward(model(batch.float()).sum())
                optimizer.step()
                optimizer.zero_grad()
                if accelerator.sync_gradients:
                    synced.append(number)
        found.append(synced)
    return found


def main(out: Path) -> None:
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=STEPS)
    rank = accelerator.process_index
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    loader = make_loader()
    model, optimizer, prepared = accelerator.prepare(model, optimizer, loader)
    result: dict = {"rank": rank, "prepare_returns_it": prepared is loader}
    result["asyncload_syncs"] = syncs(accelerator, model, optimizer, loader)
    reference = DataLoader(torch.arange(ITEMS * 2, dtype=torch.float32).view(ITEMS, 2), batch_size=BATCH)
    result["dataloader_syncs"] = syncs(accelerator, model, optimizer, accelerator.prepare(reference))

    try:
        next(iter(accelerator.skip_first_batches(loader, 2)))
        result["skip_first_batches"] = "no error"
    except TypeError as error:
        result["skip_first_batches"] = str(error)
    loader.close()

    # mid-epoch save_state (rank 0 writes the loader's state) and load_state in a new loader
    loader = make_loader()
    accelerator.register_for_checkpointing(loader)
    loader.set_epoch(1)
    batches = iter(loader)
    before = [int(row[0]) for _ in range(SAVE_AFTER) for row in next(batches)]
    accelerator.save_state(str(out / "state"))
    accelerator.wait_for_everyone()
    del batches
    loader.close()

    resumed = make_loader()
    again = Accelerator(cpu=True, gradient_accumulation_steps=STEPS)  # as a new run of the script
    again.register_for_checkpointing(resumed)
    again.load_state(str(out / "state"))
    after = [int(row[0]) for batch in resumed for row in batch]
    result.update(before=before, after=after, epoch_order=resumed.sampler.order(1).tolist())
    resumed.close()
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    accelerator.end_training()


if __name__ == "__main__":
    debug_launcher(main, args=(Path(sys.argv[1]),), num_processes=2)
