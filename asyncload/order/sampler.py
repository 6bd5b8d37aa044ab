"""The order of one epoch, from ``(seed, epoch)`` alone, sharded like ``DistributedSampler``."""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Sequence

import numpy as np

from .epoch_size import EpochSize

SOURCE_PROBES = 64  # items of the source a fingerprint looks at: evenly spaced, first and last included


def source_digest(source: Sequence[Any]) -> str:
    """A short digest of which source this is: its type, length and ``SOURCE_PROBES`` evenly
    spaced items. Hashing every item would cost seconds for millions of them, at each
    ``state_dict()``; another source almost always differs in one of these."""
    count = len(source)
    probes = sorted({round(i * (count - 1) / (SOURCE_PROBES - 1)) for i in range(SOURCE_PROBES)}) if count else []
    digest = hashlib.sha256(f"{count}".encode())
    for index in probes:
        digest.update(_stable_text(source[index]).encode())
    return digest.hexdigest()[:16]


def _stable_text(item: Any) -> str:
    """Text for an item that is the same in every process: the value of strings, numbers and
    tuples or lists of them; only the type of anything else (a default ``repr`` holds a memory
    address, which would refuse every resume in a new process)."""
    if isinstance(item, (str, bytes, int, float)):
        return repr(item)
    if isinstance(item, (tuple, list)):
        return "(" + ",".join(_stable_text(part) for part in item) + ")"
    return type(item).__qualname__


class EpochSampler:
    """Splits an epoch's order into this rank's batches of source indices.

    Sharding keeps ``DistributedSampler``'s semantics so every rank gets the same number of
    samples (no DDP hang at epoch end): with ``drop_last`` the tail that does not divide evenly
    is dropped, otherwise the order is padded by repeating its start. ``drop_last`` also drops
    this rank's final short batch. The arithmetic is ``size``'s (``epoch_size.py``).
    """

    def __init__(
        self,
        num_items: int,
        batch_size: int,
        *,
        shuffle: bool,
        seed: int,
        drop_last: bool,
        rank: int,
        world_size: int,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.num_items = num_items
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.rank = rank
        self.world_size = world_size
        self.follow: Callable[[int], None] | None = None  # the loader's set_epoch

    def set_epoch(self, epoch: int) -> None:
        """The loader's ``set_epoch``: PyTorch Lightning calls ``loader.sampler.set_epoch`` each
        epoch (as a ``DistributedSampler``'s), never the loader's own."""
        if self.follow is None:
            raise RuntimeError("this sampler belongs to no AsyncLoader: call the loader's set_epoch")
        self.follow(epoch)

    @property
    def size(self) -> EpochSize:
        """The epoch's arithmetic: samples per rank, padding, batches, the last batch's size."""
        return EpochSize(self.num_items, self.world_size, self.batch_size, self.drop_last)

    @property
    def samples_per_rank(self) -> int:
        return self.size.per_rank

    def __len__(self) -> int:
        """Batches per epoch for this rank."""
        return self.size.batches

    def identity(self) -> dict[str, Any]:
        """What, beside the seed, sizes, rank and world size, decides the order: resuming with
        another value of any of these would deliver another permutation (skipping some samples,
        repeating others), so ``load_state_dict`` refuses it."""
        return {"sampler": type(self).__name__, "shuffle": self.shuffle, "drop_last": self.drop_last,
                "num_items": self.num_items}

    def permutation(self, epoch: int) -> np.ndarray:
        """Every source index once, in ``epoch``'s order, before it is dealt to the ranks."""
        if self.shuffle:
            return np.random.default_rng([self.seed, epoch]).permutation(self.num_items)
        return np.arange(self.num_items)

    def order(self, epoch: int) -> np.ndarray:
        """This rank's source indices for ``epoch``, in delivery order (int64)."""
        return self.size.deal(self.permutation(epoch), self.rank)

    def orders_at(self, epoch: int, world_size: int) -> list[np.ndarray]:
        """Every rank's ``order(epoch)`` had there been ``world_size`` ranks: what the positions
        in each of their ``state_dict()``s refer to, for an elastic resume."""
        whole = self.permutation(epoch)
        size = self.size.of(self.num_items, world_size)
        return [size.deal(whole, rank) for rank in range(world_size)]

    def batches(self, epoch: int) -> list[np.ndarray]:
        """This rank's batches for ``epoch``: ``len(self)`` arrays of source indices."""
        order = self.order(epoch)
        return [order[start : start + self.batch_size] for start in range(0, len(self) * self.batch_size, self.batch_size)]
