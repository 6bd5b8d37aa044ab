"""The ranged reads of an epoch run over tar (or Parquet) shards, planned once by the driver:
runs of neighbouring wanted samples of a shard, each one read of up to ``chunk_bytes``, in the
order the epoch first needs them (``ShardStream`` serves them)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import numpy as np

from .shards import ShardSource


@dataclass
class Chunk:
    """One ranged read: bytes ``[start, end)`` of shard ``url``, holding samples ``indices``."""

    url: str
    start: int
    end: int
    indices: list[int]
    task: asyncio.Task | None = None
    copy: Any = None  # the cached copy its bytes came from (None: storage, or not read yet)


def plan_chunks(source: ShardSource, wanted: np.ndarray, chunk_bytes: int) -> list[Chunk]:
    """Ranged reads for the samples ``wanted`` (sample numbers in the order the epoch needs them):
    shards in the order of their first need, and within a shard runs of neighbouring samples,
    each read at most ``chunk_bytes`` long (a sample larger than that is read alone, or with the
    samples that share its bytes). A source that is parsed a shard at a time (``read_whole``:
    Parquet row groups) reads each shard's wanted samples in one read of the shard."""
    unique = np.flatnonzero(np.bincount(wanted, minlength=len(source)))  # ascending: storage order, so by shard
    shard_of = source.shard_of[unique]
    groups = np.split(unique, np.flatnonzero(np.diff(shard_of)) + 1) if len(unique) else []
    shards, first_need = np.unique(source.shard_of[wanted], return_index=True)
    group_of = dict(zip(shards.tolist(), groups))
    chunks: list[Chunk] = []
    for shard in shards[np.argsort(first_need, kind="stable")].tolist():
        indices = group_of[shard]
        if getattr(source, "read_whole", False):
            begin, end = source.sample_begin[indices[0]], source.sample_end[indices[0]]
            chunks.append(Chunk(source.urls[shard], int(begin), int(end), indices.tolist()))
            continue
        breaks = np.flatnonzero(np.diff(indices) != 1) + 1
        for run in np.split(indices, breaks):
            chunks.extend(_split_run(source, shard, run, chunk_bytes))
    return chunks


@dataclass
class ChunkPlan:
    """The ranged reads of one epoch run, in the order it needs them, and the samples it wants
    more than once (DDP's padding inside the order), with how often."""

    chunks: list[Chunk]
    repeats: dict[int, int]

    def owned(self, owner: int, owners: int) -> "ChunkPlan":
        """The chunks process ``owner`` of ``owners`` reads: every ``owners``-th, so each process
        reads its part in the epoch's order and a batch's rows spread over the processes."""
        if owners == 1:
            return self
        chunks = [Chunk(c.url, c.start, c.end, c.indices) for c in self.chunks[owner::owners]]
        mine = {index for chunk in chunks for index in chunk.indices}
        return ChunkPlan(chunks, {index: count for index, count in self.repeats.items() if index in mine})

    def owner_of(self, samples: int, owners: int) -> np.ndarray:
        """The process that reads each sample (``owners`` processes), -1 for a sample no chunk
        holds (padding repeats it after its chunk was read: any process reads it alone)."""
        owner = np.full(samples, -1, dtype=np.int16)
        for number, chunk in enumerate(self.chunks):
            owner[chunk.indices] = number % owners
        return owner


def plan_reads(source: ShardSource, wanted: np.ndarray) -> ChunkPlan:
    """The chunk plan of a run that wants the samples ``wanted``, in that order."""
    counts = np.bincount(wanted, minlength=len(source))
    repeated = np.flatnonzero(counts > 1)
    return ChunkPlan(plan_chunks(source, wanted, source.chunk_bytes), dict(zip(repeated.tolist(), counts[repeated].tolist())))


def _split_run(source: ShardSource, shard: int, run: np.ndarray, chunk_bytes: int) -> list[Chunk]:
    chunks = []
    begin, end = source.sample_begin[run], source.sample_end[run]
    start = 0
    while start < len(run):
        stop = int(np.searchsorted(end, begin[start] + chunk_bytes, side="right"))
        # at least the first sample, and every one whose bytes begin with it (the rows of a
        # litdata chunk share one Arrow footer: one read of it, not one per row)
        stop = max(stop, int(np.searchsorted(begin, begin[start], side="right")))
        chunks.append(Chunk(source.urls[shard], int(begin[start]), int(end[stop - 1]), run[start:stop].tolist()))
        start = stop
    return chunks
