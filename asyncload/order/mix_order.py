"""The epoch order of a mixed source: its seeded sequence, dealt to ranks like any other order.

Because the whole mixed sequence is the order, everything that works on positions of the order
works unchanged: ranks take disjoint parts of equal length (``EpochSize.deal``), ``state_dict()`` records
positions handed out, and a resume delivers exactly the rest of the same sequence.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..sources.mix import MixedSource
from ..sources.shards import ShardSource
from .sampler import EpochSampler


class MixSampler(EpochSampler):
    """``EpochSampler`` over ``MixedSource.sequence``: ``num_items`` is the epoch's length (not
    ``len(source)``); ``shuffle=False`` keeps each source's own order, the draw stays seeded."""

    def __init__(self, source: MixedSource, batch_size: int, **kwargs: Any) -> None:
        super().__init__(source.epoch_length, batch_size, **kwargs)
        self.source = source
        self._cached: tuple[int, np.ndarray] | None = None  # the last epoch's sequence: order() and state share it

    def identity(self) -> dict[str, Any]:
        """The base order's, plus the mix's names, weights, lengths, seed and stop rule."""
        return {**super().identity(), "mix": self.source.identity()}

    def permutation(self, epoch: int) -> np.ndarray:
        """The epoch's mixed sequence (indices of the mix), before it is dealt to the ranks."""
        if self._cached is None or self._cached[0] != epoch:
            self._cached = (epoch, self.source.sequence(epoch, self.seed, self.shuffle))
        return self._cached[1]

    def order(self, epoch: int) -> np.ndarray:
        """This rank's part: dealt as ``DistributedSampler`` does; for a mix of shard sources a
        contiguous part of the sequence (same lengths and padding), so that each rank reads a
        stretch of each source's shard order, not every ``world_size``-th sample of every shard
        (which would break each shard's chunks into reads of a sample or two)."""
        sequence = self.permutation(epoch)
        if not isinstance(self.source, ShardSource) or self.world_size == 1:
            return self.size.deal(sequence, self.rank)
        return self.size.stretch(sequence, self.rank)

    def orders_at(self, epoch: int, world_size: int) -> list[np.ndarray]:
        """Elastic resume counts source indices left, which a mix may repeat (``"never"``): not
        supported, said plainly rather than resuming wrongly."""
        raise ValueError("resuming a mixed source at another world size is not supported: resume at the same "
                         "world size, or start the epoch again")
