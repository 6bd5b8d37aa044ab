"""The mixed source: several sources laid end to end, and the seeded weighted sequence
that is its epoch order (``mix()`` in ``mix.py`` builds one; ``shard_mix.py`` extends it to
shard sources). See ``mix.py`` for what a mix is.
"""

from __future__ import annotations

import bisect
import hashlib
from typing import Any, Mapping, Sequence

import numpy as np

from .items import checked_index

STOPS = ("first", "all", "never")
DRAW_STREAM = 0x6D6978  # "mix": keeps the draw's random stream apart from the sources' own


def name_key(name: str) -> int:
    """A number for ``name`` that is the same in every process and run (``hash`` is not)."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")


def apportion(weights: np.ndarray, total: int) -> np.ndarray:
    """``total`` split in proportion to ``weights`` (summing to 1), by largest remainder: the
    counts add up to ``total`` and each is within one of its exact share."""
    exact = weights * total
    counts = np.floor(exact).astype(np.int64)
    short = total - int(counts.sum())
    if short > 0:
        counts[np.argsort(-(exact - counts), kind="stable")[:short]] += 1
    return counts


class MixedSource(Sequence):
    """Several sources mixed by weight (build it with ``mix``). As a sequence it is the sources
    laid end to end: ``len(mixed)`` items, ``mixed[i]`` the item of the source that holds index
    ``i``; what an epoch delivers is ``sequence(epoch)``, ``epoch_length`` items long."""

    def __init__(self, sources: Mapping[str, Sequence[Any]], weights: Mapping[str, float], seed: int, stop: str,
                 length: int | None) -> None:
        self.names = tuple(sources)
        self.sources = tuple(sources[name] for name in self.names)
        raw = np.array([float(weights[name]) for name in self.names], dtype=np.float64)
        self.weights = raw / raw.sum()
        self.seed, self.stop, self.length = seed, stop, length
        self.lengths = np.array([len(s) for s in self.sources], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)
        self._starts = self.offsets[:-1].tolist()  # bisect on a list: ~0.1 us a sample, no NumPy call

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def locate(self, index: int) -> tuple[Sequence[Any], int, int]:
        """Index ``index`` of the mix -> (its source, the index there, the source's number)."""
        number = bisect.bisect_right(self._starts, index) - 1
        return self.sources[number], index - self._starts[number], number

    def __getitem__(self, index: int) -> Any:  # type: ignore[override]
        source, local, _ = self.locate(checked_index(index, len(self), "mixed source"))
        return source[local]

    def source_of(self, indices: np.ndarray) -> np.ndarray:
        """The source number of each index of the mix (int64)."""
        return np.searchsorted(self.offsets, np.asarray(indices), side="right").astype(np.int64) - 1

    @property
    def epoch_length(self) -> int:
        """Samples in one epoch, before it is dealt to ranks: ``"all"`` every item once,
        ``"never"`` ``length``, ``"first"`` as many as the weights allow before a source runs out."""
        if self.stop == "all":
            return len(self)
        if self.stop == "never":
            return int(self.length or 0)
        return int(self._first_counts().sum())

    def _first_counts(self) -> np.ndarray:
        """With ``stop="first"``: each source's share of the longest epoch no source runs out in."""
        total = int(np.floor(np.min(self.lengths / self.weights) + 1e-9))
        return np.minimum(apportion(self.weights, total), self.lengths)

    def identity(self) -> dict[str, Any]:
        """What, beside the loader's settings, decides the sequence (``load_state_dict`` checks it)."""
        return {"names": list(self.names), "weights": [round(float(w), 12) for w in self.weights],
                "lengths": self.lengths.tolist(), "mix_seed": self.seed, "stop": self.stop, "length": self.length}

    def draw(self, epoch: int, seed: int = 0) -> np.ndarray:
        """Which source gives each sample of ``epoch`` (source numbers, int8..int64)."""
        rng = np.random.default_rng([self.seed, seed, epoch, DRAW_STREAM])
        if self.stop == "all":
            return self._draw_until_all_out(rng)
        counts = self._first_counts() if self.stop == "first" else apportion(self.weights, int(self.length or 0))
        ids = np.repeat(np.arange(len(self.names), dtype=np.int64), counts)
        rng.shuffle(ids)  # each source exactly its share, in a seeded order
        return ids

    def _draw_until_all_out(self, rng: np.random.Generator) -> np.ndarray:
        """Draws by weight, one source at a time, until every item is drawn; a source that runs
        out drops out and the others' weights are renormalised. Vectorised: a block of draws at
        the current weights, cut right after the draw that empties a source."""
        remaining = self.lengths.copy()
        parts = []
        while remaining.sum() > 0:
            p = np.where(remaining > 0, self.weights, 0.0)
            draws = rng.choice(len(p), size=int(remaining.sum()), p=p / p.sum())
            cut = len(draws)
            for number in np.flatnonzero(remaining > 0):
                where = np.flatnonzero(draws == number)
                if len(where) >= remaining[number]:
                    cut = min(cut, int(where[remaining[number] - 1]) + 1)
            parts.append(draws[:cut])
            remaining -= np.bincount(draws[:cut], minlength=len(p))
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)

    def sequence(self, epoch: int, seed: int = 0, shuffle: bool = True) -> np.ndarray:
        """The epoch's samples as indices of the mix (int64): the draw, each source's rows taking
        its items in its own order from ``(seeds, epoch, name)``, reshuffled at each cycle
        (``"never"``). ``shuffle=False`` keeps each source's own order."""
        ids = self.draw(epoch, seed)
        out = np.empty(len(ids), dtype=np.int64)
        for number, name in enumerate(self.names):
            rows = np.flatnonzero(ids == number)
            size = int(self.lengths[number])
            cycles = -(-len(rows) // size) if size else 0
            orders = [self.own_order(number, np.random.default_rng([self.seed, seed, epoch, name_key(name), cycle]))
                      if shuffle else np.arange(size) for cycle in range(cycles)]
            items = np.concatenate(orders)[: len(rows)] if orders else np.zeros(0, dtype=np.int64)
            out[rows] = self.offsets[number] + items
        return out

    def own_order(self, number: int, rng: np.random.Generator) -> np.ndarray:
        """One shuffled pass over source ``number``'s items (its local indices): a permutation
        here; shard sources read in shard order (``MixedShards``)."""
        return rng.permutation(int(self.lengths[number]))

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}: {len(s)} items x {w:.3g}" for n, s, w in zip(self.names, self.sources, self.weights))
        return f"MixedSource({parts}; stop={self.stop!r})"
