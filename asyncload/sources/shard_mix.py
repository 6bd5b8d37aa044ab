"""A mix of shard sources (all ``tar_shards`` or all ``parquet``) read as ONE shard set.

Why one: the shard stream, the chunk plan, the processes' chunk ownership and the disk cache
work on a single ``ShardSource`` (its ``urls``, ``shard_of``, ``shard_first``, byte ranges and
``split_chunk``). ``MixedShards`` is both a ``MixedSource`` (the index space is the sources laid
end to end, the epoch is the mix's seeded weighted sequence) and a ``ShardSource`` whose shards
are every source's shards, concatenated: the shard numbers and sample indices of source ``k`` are
shifted by the shards and samples before it, so a sample index of the mix is a sample index of
the combined shard set and all of that machinery runs unchanged. A chunk never spans two shards,
so ``split_chunk`` hands each read to the source that owns its shard, in that source's indices.

Reads stay large because each source's own order within the mix is a shard order
(``own_order``): its shards shuffled, then its buffer shuffle, as ``ShardSampler`` orders a
single shard set. The weighted draw then alternates between a few open shards (about one per
source, plus what the shuffle buffers span), and the run's plan reads each in a few chunks,
not a read per sample.
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping, Sequence

import numpy as np

from .items import checked_index
from .mix_source import MixedSource
from .shards import ShardSample, ShardSource, buffer_shuffle


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
