"""PyTorch Lightning DDP on CPU (2 processes, gloo) as its docs show it, for ``tests/test_trainers.py``:

    python tests/lightning_ddp.py OUT

The loaders are built at the top of the script, before ``Trainer.fit``: rank 0 builds them with no
distributed environment at all, and Lightning's launcher starts rank 1 (this script again) with
``LOCAL_RANK=1`` and ``WORLD_SIZE=2`` but no ``RANK``. Two fits of two epochs: ``stopped``
(saves a checkpoint mid-epoch 1, on rank 0 alone as Lightning does, and stops) and ``resumed``
(``fit(ckpt_path=...)``). Before the first fit, rank 0 (no launcher's variable yet) looks at a
batch and takes a state: that must not pin it to rank 0 of 1. Each rank writes ``OUT/<fit>.rank<r>.json``: the sample
indices of each training epoch's batches, and of each validation.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning as L
import numpy as np
import torch

from asyncload import AsyncLoader

ITEMS, VAL_ITEMS, BATCH = 36, 10, 4  # 36 / 2 ranks = 18 a rank: 5 batches, the last short
STOP_AT = (1, 2)  # (epoch, batch): the checkpoint is taken after this batch


def index_sample(i: int) -> np.ndarray:
    """A sample whose content is its index: what the model sees identifies it."""
    return np.full(2, i, np.float32)


def loaders() -> tuple[AsyncLoader, AsyncLoader]:
    train = AsyncLoader(list(range(ITEMS)), batch_size=BATCH, shuffle=True, seed=5, read=False,
                        decode=index_sample, num_threads=1)
    val = AsyncLoader(list(range(VAL_ITEMS)), batch_size=BATCH, shuffle=False, read=False,
                      decode=index_sample, num_threads=1)
    return train, val


class Recorder(L.LightningModule):
    def __init__(self, stop: Path | None = None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.stop = stop
        self.train_seen: dict[int, list[int]] = {}
        self.val_seen: dict[int, list[int]] = {}

    def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
        self.train_seen.setdefault(self.current_epoch, []).extend(batch[:, 0].long().tolist())
        return self.layer(batch).sum() * 0.0

    def on_train_batch_end(self, outputs, batch, index: int) -> None:
        if self.stop is not None and (self.current_epoch, index) == STOP_AT:
            self.trainer.save_checkpoint(self.stop)  # written by rank 0: its loader's state
            self.trainer.should_stop = True

    def validation_step(self, batch: torch.Tensor, index: int) -> None:
        if not self.trainer.sanity_checking:
            self.val_seen.setdefault(self.current_epoch, []).extend(batch[:, 0].long().tolist())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def fit(name: str, out: Path, stop: Path | None = None, resume: Path | None = None) -> None:
    train, val = loaders()  # before fit, as Lightning's docs build a DataLoader
    if name == "stopped" and "LOCAL_RANK" not in os.environ:  # rank 0 before the first fit: rank 0 of 1 so far
        assert len(next(iter(train))) == BATCH and train.state_dict()["world_size"] == 1
    model = Recorder(stop)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, train_dataloaders=train, val_dataloaders=val, ckpt_path=resume)
    result = {"rank": trainer.global_rank, "batches": len(train), "train": model.train_seen, "val": model.val_seen}
    (out / f"{name}.rank{trainer.global_rank}.json").write_text(json.dumps(result))
    train.close()
    val.close()


if __name__ == "__main__":
    out = Path(sys.argv[1])
    fit("stopped", out, stop=out / "mid.ckpt")
    fit("resumed", out, resume=out / "mid.ckpt")
