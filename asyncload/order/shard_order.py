"""The order of an epoch over tar shards: the shard order is shuffled, each rank takes a
contiguous part of that stream (so it reads few shards), then a seeded shuffle buffer mixes
samples across neighbouring shards. A plain array of positions, from ``(seed, epoch)`` alone, so
resume, exactly-once delivery and the skip policy work as for single objects.
"""

from __future__ import annotations

import copy
import hashlib
from typing import Any

import numpy as np

from ..sources.shards import ShardSource, buffer_shuffle
from .sampler import EpochSampler


class ShardSampler(EpochSampler):
    """``EpochSampler`` for shards: each rank takes a contiguous part of the shard-ordered stream
    (so it reads few shards, not a slice of all of them), with the same lengths, padding and
    ``drop_last`` as ``DistributedSampler``; the shard order and the buffer shuffle come from
    ``(seed, epoch)`` (and the rank), the same on every machine."""

    def __init__(self, source: ShardSource, batch_size: int, **kwargs: Any) -> None:
        super().__init__(len(source), batch_size, **kwargs)
        self.source = source

    def identity(self) -> dict[str, Any]:
        """The base order's, plus what shapes a shard order: the shuffle buffer, the members
        read, and the shards' boundaries and URLs."""
        source = self.source
        layout = hashlib.sha256(np.ascontiguousarray(source.shard_first).tobytes())
        layout.update("\n".join(source.urls).encode())
        return {**super().identity(), "shuffle_buffer": source.shuffle_buffer, "members": source.members,
                "shards": layout.hexdigest()[:16]}

    def order(self, epoch: int) -> np.ndarray:
        source = self.source
        shards = np.arange(len(source.urls))
        if self.shuffle:
            shards = np.random.default_rng([self.seed, epoch]).permutation(shards)
        stream = np.concatenate([np.arange(source.shard_first[s], source.shard_first[s + 1]) for s in shards] or [[]])
        mine = self.size.stretch(stream, self.rank)
        if not self.shuffle:
            return mine
        rng = np.random.default_rng([self.seed, epoch, self.rank, 1])
        return buffer_shuffle(mine, source.shuffle_buffer, rng)

    def orders_at(self, epoch: int, world_size: int) -> list[np.ndarray]:
        """Every rank's ``order(epoch)`` had there been ``world_size`` ranks (each rank's part of
        the stream and its buffer shuffle depend on its rank)."""
        orders = []
        for rank in range(world_size):
            other = copy.copy(self)
            other.rank, other.world_size = rank, world_size
            orders.append(other.order(epoch))
        return orders
