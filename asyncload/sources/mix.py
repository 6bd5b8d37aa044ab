"""Mixing datasets: several sources drawn by weight into one epoch.

The mix is itself a source: its index space is the sources laid end to end (``mix[i]`` is an
item of one of them), and its epoch sequence, which source gives each row and which of its items,
is a function of ``(seed, loader seed, epoch)`` alone. ``MixSampler`` (``order/mix_order.py``)
makes that sequence the epoch's order, so dealing to ranks, ``state_dict()`` and resume work as
for any source: a resumed epoch delivers exactly the rest of the same mixed sequence.

Each sample says which source it came from: the batch gains an int64 field, the index of the
source's name in ``sources`` (see ``mix``), written by the decode threads like a label.
"""

from __future__ import annotations

import bisect
import hashlib
from typing import Any, Mapping, Sequence

import numpy as np

from .items import checked_index, is_labelled
from .shards import ShardSample, ShardSource, buffer_shuffle


# ----- mix source -----
# The mixed source: several sources laid end to end, and the seeded weighted sequence
# that is its epoch order (``mix()``, below, builds one; ``MixedShards``, below, extends it to
# shard sources). See ``mix()`` for what a mix is.

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


# ----- shard mix -----
# A mix of shard sources (all ``tar_shards`` or all ``parquet``) read as ONE shard set.
#
# Why one: the shard stream, the chunk plan, the processes' chunk ownership and the disk cache
# work on a single ``ShardSource`` (its ``urls``, ``shard_of``, ``shard_first``, byte ranges and
# ``split_chunk``). ``MixedShards`` is both a ``MixedSource`` (the index space is the sources laid
# end to end, the epoch is the mix's seeded weighted sequence) and a ``ShardSource`` whose shards
# are every source's shards, concatenated: the shard numbers and sample indices of source ``k`` are
# shifted by the shards and samples before it, so a sample index of the mix is a sample index of
# the combined shard set and all of that machinery runs unchanged. A chunk never spans two shards,
# so ``split_chunk`` hands each read to the source that owns its shard, in that source's indices.
#
# Reads stay large because each source's own order within the mix is a shard order
# (``own_order``): its shards shuffled, then its buffer shuffle, as ``ShardSampler`` orders a
# single shard set. The weighted draw then alternates between a few open shards (about one per
# source, plus what the shuffle buffers span), and the run's plan reads each in a few chunks,
# not a read per sample.

def _same(parts: Sequence[ShardSource], what: str) -> Any:
    """The value of option ``what`` that every source shares; a ValueError naming it otherwise
    (one stream reads all of them: it has one cache and reads every sample the same way)."""
    values = [getattr(part, what, None) for part in parts]
    if any(value != values[0] for value in values):
        raise ValueError(f"mix(): shard sources must share {what}= to be read as one shard set, got {values}")
    return values[0]


class MixedShards(MixedSource, ShardSource):
    """Shard sources mixed by weight (build it with ``mix``): as a ``MixedSource``, the mix's
    index space and epoch sequence; as a ``ShardSource``, the shards of all sources, one shard set
    whose sample ``i`` is the mix's item ``i``."""

    def __init__(self, sources: Mapping[str, Sequence[Any]], weights: Mapping[str, float], seed: int, stop: str,
                 length: int | None) -> None:
        MixedSource.__init__(self, sources, weights, seed, stop, length)
        parts: list[ShardSource] = list(self.sources)  # type: ignore[arg-type]
        self.read_whole = type(parts[0]).read_whole
        self.members = _same(parts, "members")
        self.cache_dir = _same(parts, "cache_dir")
        self.columns = _same(parts, "columns")
        self.storage_options = parts[0].storage_options
        self.chunk_bytes = min(part.chunk_bytes for part in parts)  # each source's bound on one read holds
        self.cache_bytes = min((part.cache_bytes for part in parts if part.cache_bytes is not None), default=None)
        self.shuffle_buffer = max(part.shuffle_buffer for part in parts)
        self.classes: list[str] = []  # each source keeps its own classes and labels
        shard_counts = [len(part.urls) for part in parts]
        self.shard_offsets = np.concatenate([[0], np.cumsum(shard_counts)]).astype(np.int64)
        self.urls = [url for part in parts for url in part.urls]
        self.shard_bytes = np.concatenate([part.shard_bytes for part in parts]).astype(np.int64)
        self.shard_of = np.concatenate([part.shard_of.astype(np.int64) + first
                                        for part, first in zip(parts, self.shard_offsets[:-1])]).astype(np.int32)
        self.shard_first = np.concatenate([[0], *[part.shard_first[1:] + first
                                                  for part, first in zip(parts, self.offsets[:-1])]]).astype(np.int64)
        self.sample_begin = np.concatenate([part.sample_begin for part in parts]).astype(np.int64)
        self.sample_end = np.concatenate([part.sample_end for part in parts]).astype(np.int64)
        if all(hasattr(part, "default_decode") for part in parts):  # mds / litdata: the same columns' decode
            _same(parts, "image"), _same(parts, "label")  # one decode reads every source's samples
            self.default_decode = parts[0].default_decode
        labels = [part.labels for part in parts]
        self.labels = None if any(label is None for label in labels) else np.concatenate(labels).astype(np.int64)

    def __len__(self) -> int:
        return MixedSource.__len__(self)

    def __getitem__(self, index: int) -> Any:  # type: ignore[override]
        """The mix's item ``index`` as a sample of the combined shard set: its ``ShardSample``
        carries the mix's index (the stream serves it by that), its label stays its source's."""
        index = checked_index(index, len(self), "mixed shard source")
        part, local, _ = self.locate(index)
        item = part[local]
        sample, label = item if isinstance(item, tuple) else (item, None)
        sample = ShardSample(sample.shard, sample.key, index)
        return sample if label is None else (sample, label)

    def split_chunk(self, view: memoryview, base: int, indices: list[int]) -> dict[int, Any]:
        """The samples of one read (all of one shard, so of one source), cut by that source in
        its own indices and given back in the mix's."""
        part, _, number = self.locate(indices[0])
        first = int(self.offsets[number])
        out = part.split_chunk(view, base, [index - first for index in indices])  # type: ignore[attr-defined]
        return {local + first: sample for local, sample in out.items()}

    def own_order(self, number: int, rng: np.random.Generator) -> np.ndarray:
        """Source ``number``'s pass in shard order: its shards shuffled, then its buffer shuffle
        (``ShardSampler``'s order), so neighbouring draws of a source share a shard chunk."""
        part: ShardSource = self.sources[number]  # type: ignore[assignment]
        shards = rng.permutation(len(part.urls))
        stream = np.concatenate([np.arange(part.shard_first[s], part.shard_first[s + 1]) for s in shards] or [[]])
        return buffer_shuffle(stream.astype(np.int64), part.shuffle_buffer, rng)

    def identity(self) -> dict[str, Any]:
        """The mix's, plus what shapes each source's shard order and what a sample reads as."""
        layout = hashlib.sha256(np.ascontiguousarray(self.shard_first).tobytes())
        layout.update("\n".join(self.urls).encode())
        return {**MixedSource.identity(self), "members": self.members, "shards": layout.hexdigest()[:16],
                "shuffle_buffers": [int(part.shuffle_buffer) for part in self.sources]}  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        return "MixedShards" + MixedSource.__repr__(self)[len("MixedSource"):]


def mix(sources: Mapping[str, Sequence[Any]], weights: Mapping[str, float], *, seed: int = 0, stop: str = "first",
        length: int | None = None) -> MixedSource:
    """Several sources as one, each batch's rows drawn from them by weight: pass the result to
    ``AsyncLoader`` as its source.

    The draw is seeded: the same ``seed``, loader ``seed``, epoch and rank give the same sequence;
    within a source, items come in its own shuffled order from ``(seed, epoch, name)`` (for shard
    sources a shard order: shards shuffled, then a buffer shuffle, so reads stay large). With
    ``stop="first"`` and ``"never"`` each source gives exactly its weighted share of the epoch, in
    a seeded order; with ``"all"`` each sample's source is drawn by weight, a source that runs out
    drops out and the others' weights are renormalised.

    Each sample says where it came from: batches are ``(images, labels, source_ids)`` for sources
    of ``(url, label)`` items, ``(images, source_ids)`` for bare URLs (a custom ``decode``'s sample
    takes the place of ``images``), ``source_ids`` int64, the position of the sample's source in
    ``sources`` (``list(sources)[source_id]`` names it). Labels stay each source's own.
    ``loader.stats.sources`` counts the samples handed out per source (``as_dict()``:
    ``"mix/<name>/samples"``).

    Args:
        sources (dict of str -> source): name -> a source: ``image_folder``, ``list_files``,
            ``manifest`` or any sized, indexable sequence of items; or all ``tar_shards``, or all
            ``parquet`` (read as one shard set: see ``MixedShards``). All labelled or none.
        weights (dict of str -> float): the same names, positive numbers, normalised to sum 1.
        seed (int): the draw's and the sources' shuffles' seed (the loader's ``seed`` is added).
        stop ("first", "all" or "never"): when an epoch ends: "first" as soon as one source
            has given all its items (the others give their weighted share of that length);
            "all" once every source has (each item once); "never" after ``length`` samples,
            sources cycling (each pass a new shuffle).
        length (int): samples per epoch; required with ``stop="never"``, else not allowed.

    Raises:
        ValueError: names that differ between ``sources`` and ``weights``, a weight that is not
            a positive number, an empty source, labelled and unlabelled sources mixed, a ``stop``
            or ``length`` that does not fit.
        TypeError: another mix as a source; shard sources mixed with item sources, or
            ``tar_shards`` with ``parquet``.
    """
    if not sources:
        raise ValueError("mix() needs at least one source")
    if set(sources) != set(weights):
        raise ValueError(f"mix(): weights must name exactly the sources: sources {sorted(sources)}, "
                         f"weights {sorted(weights)}")
    kinds = {type(source) if isinstance(source, ShardSource) else None for source in sources.values()}
    if len(kinds) > 1:  # one shard stream reads a shard mix: every source must read the same way
        found = {name: type(source).__name__ if isinstance(source, ShardSource) else "items"
                 for name, source in sources.items()}
        raise TypeError(f"mix(): shard sources mix only with shard sources of the same kind (all tar_shards or all "
                        f"parquet), not with each other or with item sources: {found}")
    for name in sources:
        if not isinstance(name, str):
            raise ValueError(f"mix(): source names must be strings, got {name!r}")
        weight = weights[name]
        if isinstance(weight, bool) or not isinstance(weight, (int, float, np.integer, np.floating)) \
                or not np.isfinite(weight) or weight <= 0:
            raise ValueError(f"mix(): the weight of {name!r} must be a positive number, got {weight!r}")
        source = sources[name]
        if isinstance(source, MixedSource):
            raise TypeError(f"mix(): source {name!r} is a {type(source).__name__}: a mix cannot be mixed again")
        if len(source) == 0:
            raise ValueError(f"mix(): source {name!r} is empty")
    labelled = {name: is_labelled(sources[name][0]) for name in sources}
    if len(set(labelled.values())) > 1:
        raise ValueError(f"mix(): sources must all have (url, label) items or none: {labelled}")
    if stop not in STOPS:
        raise ValueError(f"mix(): stop must be 'first', 'all' or 'never', got {stop!r}")
    if stop == "never" and (isinstance(length, bool) or not isinstance(length, int) or length < 1):
        raise ValueError(f"mix(stop='never') needs length=, a positive number of samples per epoch, got {length!r}")
    if stop != "never" and length is not None:
        raise ValueError(f"mix(): length= is for stop='never' (stop={stop!r} decides the epoch's length)")
    if kinds == {None}:
        return MixedSource(sources, weights, seed, stop, length)
    return MixedShards(sources, weights, seed, stop, length)
