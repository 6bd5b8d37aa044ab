"""PyTorch Lightning on CPU as its docs show it, for ``tests/test_trainers.py``: one device, then
DDP on 2 processes (gloo):

    python tests/lightning_ddp.py OUT

One device first, in this process alone (``OUT/single.json``): a fit of three epochs with a
validation loader, then ``validate``, ``test`` and ``predict`` on that loader; the sample indices
each step saw, per stage and epoch, the training loader's order of each epoch, and the
asyncload threads still running once both loaders are closed.

Then DDP. The loaders are built at the top of the script, before ``Trainer.fit``: rank 0 builds
them with no distributed environment at all, and Lightning's launcher starts rank 1 (this script
again) with ``LOCAL_RANK=1`` and ``WORLD_SIZE=2`` but no ``RANK``. Two fits of two epochs:
``stopped`` (saves a checkpoint mid-epoch 1, on rank 0 alone as Lightning does, and stops) and
``resumed`` (``fit(ckpt_path=...)``). Before the first fit, rank 0 (no launcher's variable yet)
looks at a batch and takes a state: that must not pin it to rank 0 of 1. Each rank writes
``OUT/<fit>.rank<r>.json``: the sample indices of each training epoch's batches, and of each
validation.

Both runs share one process, so Lightning (seconds of CPU to import) is imported once by it,
once by rank 1, and never by the test's own process. This module imports it only in ``main``:
the test imports the constants.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
from pathlib import Path

import numpy as np
import torch

from asyncload import AsyncLoader

SINGLE_ITEMS, SINGLE_VAL_ITEMS, SINGLE_EPOCHS = 30, 10, 3  # one device: 8 batches an epoch, the last short
ITEMS, VAL_ITEMS, BATCH = 36, 10, 4  # DDP: 36 / 2 ranks = 18 a rank: 5 batches, the last short
STOP_AT = (1, 2)  # (epoch, batch): the checkpoint is taken after this batch


def index_sample(i: int) -> np.ndarray:
    """A sample whose content is its index: what the model sees identifies it."""
    return np.full(2, i, np.float32)


@functools.cache
def recorder_class() -> type:
    """The LightningModule the runs train, made in ``main`` (this module imports no Lightning)."""
    import lightning as L

    class Recorder(L.LightningModule):
        """Records the sample indices each step sees, per stage and epoch (validation outside the
        sanity check); with ``stop``, saves a checkpoint there after batch ``STOP_AT`` and stops."""

        def __init__(self, stop: Path | None = None) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)
            self.stop = stop
            self.seen: dict[str, dict[int, list[int]]] = {"train": {}, "val": {}, "test": {}, "predict": {}}

        def _record(self, stage: str, batch: torch.Tensor) -> torch.Tensor:
            self.seen[stage].setdefault(self.current_epoch, []).extend(batch[:, 0].long().tolist())
            return self.layer(batch).sum() * 0.0

        def training_step(self, batch, index):
            return self._record("train", batch)

        def on_train_batch_end(self, outputs, batch, index: int) -> None:
            if self.stop is not None and (self.current_epoch, index) == STOP_AT:
                self.trainer.save_checkpoint(self.stop)  # written by rank 0: its loader's state
                self.trainer.should_stop = True

        def validation_step(self, batch, index):
            if not self.trainer.sanity_checking:
                self._record("val", batch)

        def test_step(self, batch, index):
            self._record("test", batch)

        def predict_step(self, batch, index):
            return self._record("predict", batch)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    return Recorder


def trainer(**kwargs):
    import lightning as L

    return L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, **kwargs)


def single(out: Path) -> None:
    """One device: Lightning checks a loader by making an iterator and dropping it, and sets the
    epoch through ``loader.sampler.set_epoch``; its validation, test and predict paths take the
    loader (``batch_sampler``, ``dataset``)."""
    train = AsyncLoader(list(range(SINGLE_ITEMS)), batch_size=BATCH, shuffle=True, seed=7, read=False,
                        decode=index_sample, num_threads=1)
    val = AsyncLoader(list(range(SINGLE_VAL_ITEMS)), batch_size=BATCH, shuffle=False, read=False,
                      decode=index_sample, num_threads=1)
    model = recorder_class()()
    with train, val:
        trainer(devices=1, max_epochs=SINGLE_EPOCHS).fit(model, train_dataloaders=train, val_dataloaders=val)
        fit_val, model.seen["val"] = model.seen["val"], {}
        run = trainer(devices=1)
        run.validate(model, val)
        run.test(model, val)
        run.predict(model, val)
    # what conftest's no_thread_left checked when this run was in the test's process: closed, the
    # loaders leave no thread behind (Lightning made iterators and dropped them)
    threads_left = [thread.name for thread in threading.enumerate() if thread.name.startswith("asyncload")]
    orders = {epoch: train.sampler.order(epoch).tolist() for epoch in range(SINGLE_EPOCHS)}
    (out / "single.json").write_text(json.dumps({**model.seen, "fit_val": fit_val, "orders": orders,
                                                 "threads_left": threads_left}))


def loaders() -> tuple[AsyncLoader, AsyncLoader]:
    train = AsyncLoader(list(range(ITEMS)), batch_size=BATCH, shuffle=True, seed=5, read=False,
                        decode=index_sample, num_threads=1)
    val = AsyncLoader(list(range(VAL_ITEMS)), batch_size=BATCH, shuffle=False, read=False,
                      decode=index_sample, num_threads=1)
    return train, val


def fit(name: str, out: Path, stop: Path | None = None, resume: Path | None = None) -> None:
    train, val = loaders()  # before fit, as Lightning's docs build a DataLoader
    if name == "stopped" and "LOCAL_RANK" not in os.environ:  # rank 0 before the first fit: rank 0 of 1 so far
        assert len(next(iter(train))) == BATCH and train.state_dict()["world_size"] == 1
    model = recorder_class()(stop)
    run = trainer(devices=2, strategy="ddp", max_epochs=2)
    run.fit(model, train_dataloaders=train, val_dataloaders=val, ckpt_path=resume)
    result = {"rank": run.global_rank, "batches": len(train), "train": model.seen["train"], "val": model.seen["val"]}
    (out / f"{name}.rank{run.global_rank}.json").write_text(json.dumps(result))
    train.close()
    val.close()


def main(out: Path) -> None:
    if "LOCAL_RANK" not in os.environ:  # this process, before Lightning's launcher starts rank 1
        single(out)
    fit("stopped", out, stop=out / "mid.ckpt")
    fit("resumed", out, resume=out / "mid.ckpt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
