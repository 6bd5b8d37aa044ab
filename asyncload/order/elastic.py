"""Elastic resume: the rest of an epoch after the number of ranks changed.

A job saved by ``W`` ranks resumes on ``N``: the rest of the epoch is every source index that no
old rank handed out, dealt to the new ranks as ``DistributedSampler`` deals an epoch. It is
recomputed from the old ranks' ``state_dict()`` positions (a few intervals each) and the orders
those positions refer to (from ``(seed, epoch)``), never stored sample by sample, so the state
the new ranks save stays small and a resumed rank finds the same remainder as every other.
"""

from __future__ import annotations

from typing import Any

import numpy as np


ELASTIC_STREAM = 0x656C6173  # "elas": the remainder's shuffle is its own, unlike any epoch's


class Elastic:
    """The rest of an epoch that ``world_size`` old ranks had begun: each old rank's positions
    delivered and skipped (``ranks``, in rank order), and, when those ranks were themselves
    running such a rest (a second change of world size within the epoch), the ``earlier`` one.

    Skipped samples (failed with ``on_error="skip"``, already counted on the old rank's failure
    budget) are done like delivered ones: the rest does not read them again, and the new ranks'
    failure budgets span only the rest. DDP padding the old ranks delivered (repeats) makes
    nothing done that its first delivery did not; a sample an old rank delivered only as a
    repeat is done, delivered once."""

    def __init__(self, world_size: int, ranks: list[dict[str, Any]], earlier: "Elastic | None" = None) -> None:
        self.world_size = world_size
        self.ranks = [{"delivered": [list(i) for i in rank.get("delivered", [])],
                       "skipped": [list(i) for i in rank.get("skipped", [])]} for rank in ranks]
        self.earlier = earlier

    def as_state(self) -> dict[str, Any]:
        """The ``elastic`` entry of ``state_dict()``: plain lists, as small as the old states'
        positions (a few intervals per old rank)."""
        return {"world_size": self.world_size, "ranks": self.ranks,
                "earlier": None if self.earlier is None else self.earlier.as_state()}

    @classmethod
    def from_state(cls, entry: dict[str, Any] | None) -> "Elastic | None":
        if entry is None:
            return None
        return cls(entry["world_size"], entry["ranks"], cls.from_state(entry.get("earlier")))

    def remaining(self, sampler: Any, epoch: int) -> np.ndarray:
        """Every source index of ``epoch`` not done by the old ranks (nor before them), each
        once, in a seeded order the same on every new rank: shuffled from ``(seed, epoch,
        ELASTIC_STREAM, old world size)``, or ascending without ``shuffle``."""
        left = np.zeros(sampler.num_items, dtype=bool)
        orders = old_orders(sampler, epoch, self.earlier, self.world_size)
        if self.earlier is None:
            left[:] = True
        else:
            left[self.earlier.remaining(sampler, epoch)] = True
        for order, done in zip(orders, self.ranks):
            for start, stop in (*done["delivered"], *done["skipped"]):
                left[order[start:stop]] = False
        rest = np.flatnonzero(left).astype(np.int64)
        if sampler.shuffle:
            rest = np.random.default_rng([sampler.seed, epoch, ELASTIC_STREAM, self.world_size]).permutation(rest)
        return rest

    def order(self, sampler: Any, epoch: int) -> np.ndarray:
        """This rank's part of the rest, dealt like an epoch: equal lengths on every new rank,
        padded by repeating the rest's start, or its tail dropped with ``drop_last``."""
        return self.dealt(sampler, epoch)[0]

    def dealt(self, sampler: Any, epoch: int) -> tuple[np.ndarray, Any]:
        """``order`` and the rest's arithmetic (an ``EpochSize``: its batches, equal on every new
        rank, fewer than ``len(loader)``)."""
        rest = self.remaining(sampler, epoch)
        size = sampler.size.of(len(rest))
        return size.deal(rest, sampler.rank), size


def old_orders(sampler: Any, epoch: int, elastic: Elastic | None, world_size: int) -> list[np.ndarray]:
    """The order each of ``world_size`` ranks followed in ``epoch``: the epoch's own, or the rest
    of an earlier elastic resume, dealt to them."""
    if elastic is None:
        return sampler.orders_at(epoch, world_size)
    rest = elastic.remaining(sampler, epoch)
    size = sampler.size.of(len(rest), world_size)
    return [size.deal(rest, rank) for rank in range(world_size)]

