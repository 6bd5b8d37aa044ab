"""What the trainers look for in a loader beyond ``for batch in loader``, so that an
``AsyncLoader`` goes where their docs put a ``DataLoader``, with no adapter to write.

- PyTorch Lightning reads ``loader.sampler`` (it calls ``sampler.set_epoch`` each epoch: the
  sampler forwards it to the loader), ``loader.batch_sampler`` and ``loader.dataset`` (to tell
  whether a validation loader shuffles), and saves and restores ``state_dict()``.
- Hugging Face Accelerate's gradient accumulation syncs at the end of each epoch, which it learns
  from the loader being iterated (``GradientState.end_of_dataloader``): ``EpochEnd`` tells it
  as its own ``DataLoaderShard`` does. ``accelerator.skip_first_batches`` rebuilds a
  ``DataLoader`` over ``loader.dataset``: ``SourceDataset`` refuses to be read that way, naming
  what resumes an ``AsyncLoader`` instead (its state, which ``load_state`` restores).

Direct support rather than an adapter per trainer: the trainers ask for attributes and a
signal, not for a type (``accelerator.prepare`` returns any object that is not a ``DataLoader``
as it is), so the loader itself can answer, and a user writes what the trainer's docs show.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any, Iterator, Sequence

import torch.utils.data

from .order.sampler import EpochSampler


class SourceDataset(torch.utils.data.Dataset):
    """``loader.dataset``: the source's items, ``len()`` of them; ``items`` is the source.
    Not readable by a ``DataLoader``: the loader reads and decodes them itself, in batches, so a
    ``DataLoader`` built over it (``accelerator.skip_first_batches``) would give items, not
    samples; it fails at its first batch, saying what to do."""

    def __init__(self, items: Sequence[Any]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> Any:
        raise TypeError(
            "an AsyncLoader's dataset is its source's items, which the loader itself reads and decodes: a DataLoader "
            "built over it (accelerator.skip_first_batches does) would give items, not samples. To resume mid-epoch, "
            "restore the loader's state: accelerator.register_for_checkpointing(loader) before save_state/load_state, "
            "or loader.load_state_dict(state); the next pass goes on where the state stood")


class EpochBatches:
    """``loader.batch_sampler``: the source indices of each of this rank's batches of the epoch
    the next pass runs (``sampler``, ``batch_size`` and ``drop_last`` as a ``BatchSampler``'s)."""

    def __init__(self, sampler: EpochSampler, epoch: Any) -> None:
        self.sampler = sampler
        self._epoch = epoch  # () -> the epoch

    @property
    def batch_size(self) -> int:
        return self.sampler.batch_size

    @property
    def drop_last(self) -> bool:
        return self.sampler.drop_last

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.sampler.batches(self._epoch()):
            yield batch.tolist()


class EpochEnd:
    """Tells Accelerate's ``GradientState`` that a pass is under way and when its last batch is
    handed out (``end_of_dataloader``), as Accelerate's ``DataLoaderShard.begin()``/``end()`` do:
    gradient accumulation then syncs at each epoch's end, as with a prepared ``DataLoader``.
    Nothing happens unless an ``Accelerator`` exists (``accelerate`` imported and initialised)."""

    end_of_dataloader = False
    remainder = -1  # the padding Accelerate would drop in gather_for_metrics: not known here

    def __init__(self) -> None:
        self.state = gradient_state()
        if self.state is not None:
            self.state._add_dataloader(self)  # DataLoaderStateMixin.begin()'s call; kept alive by the pass

    def last(self) -> None:
        """The batch about to be handed out is the pass's last."""
        self.end_of_dataloader = True

    def end(self) -> None:
        if self.state is not None:
            self.state._remove_dataloader(self)
            self.state = None


TESTED = "accelerate 1.x (tested with 1.15)"  # whose private GradientState calls EpochEnd makes
_warned: list[str] = []  # the one warning about another accelerate, once given


def gradient_state() -> Any:
    """Accelerate's ``GradientState`` when an ``Accelerator`` was created in this process, else
    None (asyncload never imports accelerate itself). The calls used are Accelerate's private
    ones (``is_initialized``, ``GradientState._add_dataloader`` / ``_remove_dataloader``): where a
    version lacks them, None too, and a warning, once, that accumulation may not sync at each
    epoch's end."""
    state = sys.modules.get("accelerate.state")
    if state is None:
        return None
    is_initialized = getattr(state, "is_initialized", None)
    gradient = getattr(state, "GradientState", None)
    if not callable(is_initialized) or gradient is None or not all(
            callable(getattr(gradient, name, None)) for name in ("_add_dataloader", "_remove_dataloader")):
        if not _warned:
            _warned.append("once")
            version = getattr(sys.modules.get("accelerate"), "__version__", "unknown")
            warnings.warn(
                f"asyncload: this accelerate ({version}) lacks the GradientState calls asyncload uses to signal "
                f"each epoch's end (supported: {TESTED}); gradient accumulation boundaries may drift from a "
                f"prepared DataLoader's (no sync forced at the epoch's last batch)", RuntimeWarning, stacklevel=2)
        return None
    if not is_initialized():
        return None
    return gradient()
