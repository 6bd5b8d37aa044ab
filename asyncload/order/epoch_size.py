"""The epoch's arithmetic, in one place: how many samples each rank takes, how they are dealt,
the DDP padding, how many batches that makes and the size of the last one.

Every sampler (items, shards, a mix, an elastic rest) makes one ``EpochSize``; ``len(loader)``,
the plan's batches, the DDP batch quota, the progress bar, ``state_dict()`` and a resume read it
instead of working the numbers out again. ``drop_last`` is decided here: it drops the tail that
does not divide among the ranks (else the order is padded by repeating its start, as
``DistributedSampler`` pads) and the rank's last short batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BatchQuota:
    """How many batches a run must deliver whatever fails (``count``), the last one with
    ``last_size`` rows: ranks of a DDP job must all deliver the same number of batches."""

    count: int
    last_size: int


@dataclass(frozen=True)
class EpochSize:
    """``items`` samples (an epoch's order, or an elastic rest) dealt to ``world_size`` ranks in
    batches of ``batch_size``."""

    items: int
    world_size: int
    batch_size: int
    drop_last: bool

    @property
    def per_rank(self) -> int:
        """Samples each rank takes (the same on every rank: no DDP hang at the epoch's end)."""
        if self.drop_last:
            return self.items // self.world_size
        return -(-self.items // self.world_size)

    @property
    def padding(self) -> int:
        """Samples repeated from the order's start so that every rank takes ``per_rank`` (DDP
        rank padding; never with ``drop_last``)."""
        return max(0, self.per_rank * self.world_size - self.items)

    @property
    def batches(self) -> int:
        """Batches per rank: ``len(loader)``."""
        if self.drop_last:
            return self.per_rank // self.batch_size
        return -(-self.per_rank // self.batch_size)

    @property
    def last_size(self) -> int:
        """Samples in a rank's last batch."""
        if self.drop_last or self.batches == 0:
            return self.batch_size
        return self.per_rank - (self.batches - 1) * self.batch_size

    @property
    def delivered(self) -> int:
        """Samples a rank hands out in a whole epoch: ``per_rank``, less the short batch that
        ``drop_last`` drops."""
        return min(self.per_rank, self.batches * self.batch_size)

    def of(self, items: int, world_size: int | None = None) -> "EpochSize":
        """The same arithmetic over ``items`` samples (an elastic rest), or at another world size."""
        return EpochSize(items, self.world_size if world_size is None else world_size, self.batch_size, self.drop_last)

    def quota(self, batches_done: int) -> BatchQuota | None:
        """With several ranks, every rank must deliver ``batches`` batches even when samples fail
        and are skipped, or DDP hangs at the epoch's end: the batches still owed (``batches_done``
        were handed out) and the size of the last one. None with one rank."""
        if self.world_size == 1:
            return None
        return BatchQuota(self.batches - batches_done, self.last_size)

    def keeps_short_rest(self, quota: BatchQuota | None) -> bool:
        """Whether a rest too short for a batch is kept back (``drop_last`` and no DDP quota):
        the plan then uses it to replace skipped samples, and a batch that skips left short is
        dropped rather than handed out."""
        return self.drop_last and quota is None

    @property
    def smallest_batch(self) -> int:
        """The fewest samples a batch handed out may have: with ``drop_last``, a whole batch."""
        return self.batch_size if self.drop_last else 1

    def padded(self, order: np.ndarray) -> np.ndarray:
        """``order`` cut or padded to ``per_rank * world_size`` samples: the tail that does not
        divide dropped with ``drop_last``, else repeats of its start added."""
        total = self.per_rank * self.world_size
        if total > len(order) and len(order) > 0:
            order = np.resize(order, total)  # pads by repeating from the start
        return order[:total]

    def deal(self, order: np.ndarray, rank: int) -> np.ndarray:
        """``rank``'s part of ``order`` as ``DistributedSampler`` deals it: every ``world_size``-th
        index from ``rank`` (int64)."""
        return np.asarray(self.padded(order)[rank :: self.world_size], dtype=np.int64)

    def stretch(self, order: np.ndarray, rank: int) -> np.ndarray:
        """``rank``'s contiguous part of ``order`` (shards: a rank reads a stretch of the shard
        order, not every ``world_size``-th sample of every shard), of the same length (int64)."""
        per_rank = self.per_rank
        return np.asarray(self.padded(order)[rank * per_rank : (rank + 1) * per_rank], dtype=np.int64)
