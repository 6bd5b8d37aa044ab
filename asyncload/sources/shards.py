"""Tar shards (WebDataset layout: ``key.jpg`` + ``key.cls`` ... in one ``.tar``) for storage that
charges per request: one large ranged read brings in hundreds of samples.

A shard set is described by an index (``index.json``, written by ``write_shards`` or
``index_shards``) that gives every sample's members as byte ranges of its shard. With it:

- the epoch order is known up front, from ``(seed, epoch)`` alone: the shard order is shuffled,
  each rank takes a contiguous part of that stream (equal lengths, ``DistributedSampler``'s
  padding and ``drop_last``), then a seeded shuffle buffer mixes samples across neighbouring
  shards. Because the order is a plain array of positions, resume, exactly-once delivery and the
  skip policy work as for single objects;
- reads follow that order: the samples still wanted are grouped into runs of neighbouring
  samples of a shard, each run one ranged read of up to ``chunk_bytes``, fetched from the event
  loop in the order the epoch needs them, the loader's ``io_concurrency`` at once (4 by
  default: each read is large). What is read ahead of the consumer is bounded by the
  shuffle buffer, as with a streaming shuffle buffer.

This module holds the index and the source; the order is ``order/shard_order.py``, the reads
``sources/shard_stream.py``.
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..decode.names import IMAGE_EXTENSIONS
from . import listing, shard_index
from .brace import MAX_URLS
from .shard_index import INDEX_FORMAT
from .items import Source, checked_index


def buffer_shuffle(stream: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    """What a streaming shuffle buffer of ``size`` outputs for ``stream``: each step emits a
    random sample of the buffer and puts the next one of the stream in its place. So the sample
    at output position ``p`` was at most ``p + size`` samples into the stream: reading the stream
    in order, about ``size`` samples wait in memory."""
    values = stream.tolist()
    buffer = values[:size]
    picks = rng.random(len(values)).tolist()
    out = []
    upcoming = size
    for pick in picks:
        slot = int(pick * len(buffer))
        out.append(buffer[slot])
        if upcoming < len(values):
            buffer[slot] = values[upcoming]
            upcoming += 1
        else:
            buffer[slot] = buffer[-1]
            buffer.pop()
    return np.array(out, dtype=np.int64)


@dataclass(frozen=True)
class ShardSample:
    """Where one sample lives: its shard's URL, its key inside the shard, and its number in the
    shard set (storage order). Errors name it as ``shard-url#key``."""

    shard: str
    key: str
    index: int

    def __repr__(self) -> str:
        return repr(f"{self.shard}#{self.key}")


class ShardSource(Sequence):
    """The samples of a shard set, as ``(ShardSample, label)`` items when every sample has a
    ``.cls`` member, else ``ShardSample`` items. Build it with ``tar_shards(url)``.

    ``members="image"`` (default): a sample reads as the bytes of its image member, for
    ``ImageDecoder``; ``"all"``: as a dict ``{extension: bytes}`` of every member, for your own
    ``decode``. ``shuffle_buffer``: how many samples the shuffle mixes at once (memory: about that
    many encoded samples). ``chunk_bytes``: the largest single ranged read. ``cache_dir``: keep
    remote shards on local disk, at most ``cache_bytes`` (default: the smaller of 64 GiB and half
    the disk's free space at the start of a run; see ``cache/shards.py``).
    ``allow_external_shards``: trust shard URLs outside the index's folder (another protocol or
    bucket, an absolute path, ``..``), refused by default (see ``shard_index``).
    """

    read_whole = False  # True: a shard is parsed whole (a Parquet row group), one read per shard

    def __init__(
        self,
        index: dict[str, Any],
        base_url: str,
        *,
        storage_options: dict | None = None,
        allow_external_shards: bool = False,
        members: str = "image",
        shuffle_buffer: int = 1000,
        chunk_bytes: int = 16 << 20,
        cache_dir: str | None = None,
        cache_bytes: int | None = None,
    ) -> None:
        if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT:
            found = index.get("format") if isinstance(index, dict) else type(index).__name__
            raise ValueError(f"{base_url}: not an asyncload shard index (format {str(found)[:80]!r})")
        self._settings(storage_options, members, shuffle_buffer, chunk_bytes, cache_dir, cache_bytes)
        self.classes = list(index.get("classes", []))
        self._read_index(index["shards"], base_url, allow_external_shards)

    def _settings(self, storage_options: dict | None, members: str, shuffle_buffer: int, chunk_bytes: int,
                  cache_dir: str | None, cache_bytes: int | None) -> None:
        """The reading settings every shard source has (this one's, ``ChunkedSource``'s)."""
        if members not in ("image", "all"):
            raise ValueError(f"members must be 'image' or 'all', got {members!r}")
        self.storage_options = storage_options
        self.members = members
        self.shuffle_buffer = max(1, shuffle_buffer)
        self.chunk_bytes = chunk_bytes
        self.cache_dir = cache_dir
        self.cache_bytes = cache_bytes

    def _read_index(self, shards: list[dict[str, Any]], base_url: str, allow_external: bool = False) -> None:
        """Flattens the index into arrays, checked (``shard_index``): a million samples cost tens
        of MB, not a GB of objects."""
        flat = shard_index.flatten(shards, base_url, allow_external)
        self.urls = flat["urls"]
        self.shard_bytes = flat["shard_bytes"]
        counts = flat["counts"]
        self.shard_of = np.repeat(np.arange(len(counts), dtype=np.int32), counts)
        self.shard_first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.keys = Source(flat["keys"])  # one blob, not a list of str
        self.extensions: list[str] = flat["extensions"]
        self.member_start, self.member_ext = flat["member_start"], flat["member_ext"]
        self.member_offset, self.member_size = flat["member_offset"], flat["member_size"]
        labels = flat["labels"]
        self.labels = None if any(label is None for label in labels) else np.array(labels, dtype=np.int64)
        ends = self.member_offset + self.member_size
        starts = self.member_start[:-1]
        self.sample_begin = np.minimum.reduceat(self.member_offset, starts) if len(starts) else np.zeros(0, np.int64)
        self.sample_end = np.maximum.reduceat(ends, starts) if len(starts) else np.zeros(0, np.int64)

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, index: int) -> Any:  # type: ignore[override]
        index = checked_index(index, len(self), "ShardSource")
        sample = ShardSample(self.urls[self.shard_of[index]], self.keys.url(index), index)
        return sample if self.labels is None else (sample, int(self.labels[index]))

    def __repr__(self) -> str:
        return f"ShardSource({len(self)} samples in {len(self.urls)} shards, {len(self.classes)} classes)"

    def sample_members(self, index: int) -> list[tuple[str, int, int]]:
        """``(extension, offset, size)`` of each member of sample ``index``."""
        members = range(self.member_start[index], self.member_start[index + 1])
        return [(self.extensions[self.member_ext[m]], int(self.member_offset[m]), int(self.member_size[m])) for m in members]

    def split_chunk(self, view: memoryview, base: int, indices: list[int]) -> dict[int, Any]:
        """What each sample of ``indices`` reads as, cut from ``view``, the bytes of its shard
        from offset ``base`` on (one ranged read): the image member's bytes, or with
        ``members="all"`` a dict ``{extension: bytes}``. (A source may give an exception for a
        sample instead: that sample's read fails with it.) Each is a copy, so a sample that waits
        long in the shuffle does not keep the whole read alive."""
        if self.members == "image":
            out = {}
            for index in indices:
                offset, size = self.image_member(index)
                out[index] = bytes(view[offset - base : offset - base + size])
            return out
        return {index: {ext: bytes(view[offset - base : offset - base + size])
                        for ext, offset, size in self.sample_members(index)} for index in indices}

    def image_member(self, index: int) -> tuple[int, int]:
        """``(offset, size)`` of sample ``index``'s image member (``JPG`` too: an index written
        before extensions were lower-cased may hold it so)."""
        for ext, offset, size in self.sample_members(index):
            if ext.lower() in IMAGE_EXTENSIONS:
                return offset, size
        raise ValueError(f"sample {self[index]!r} has no image member ({', '.join(IMAGE_EXTENSIONS)})")


def tar_shards(url: str | Sequence[str], storage_options: dict | None = None, *, timeout: float | None = None,
               retries: int | None = None, index_dir: str | None = None, max_shards: int = MAX_URLS,
               **options: Any) -> ShardSource:
    """The shard set at ``url``: an ``index.json`` (``write_shards``, ``index_shards``), the
    folder or bucket prefix that holds one, or WebDataset tars as published: a brace pattern
    (``s3://b/train/{000000..000999}.tar``, ``{a,b}``), one ``.tar``, a list of them, or a folder
    of ``.tar`` files without an index. For those, the member table is learnt from the shards
    (one streaming read of each, before the first epoch) and kept in ``index_dir`` (default:
    ``cache_dir``'s ``indexes/``, else ``~/.cache/asyncload/indexes``) for the next runs and the
    node's other ranks (see ``shard_learn``). Requests made now end after ``timeout`` seconds
    (default: the loader's ``read_timeout``), tried ``1 + retries`` times (default 6 retries, or
    what ``storage_options`` name); then ``StorageError`` naming the URL and the attempts, or
    ``FileNotFoundError`` where there is no index and no shard. A pattern (or a list of them)
    may name at most ``max_shards`` URLs (default 1,000,000), counted from the pattern before it
    is expanded: past that, ValueError naming the pattern and its count (one digit too many in a
    range, ``{0..9999999}``, would otherwise take seconds and gigabytes before any shard is
    listed). ``options`` are ``ShardSource``'s: ``members``, ``shuffle_buffer``, ``chunk_bytes``,
    ``cache_dir``, ``cache_bytes``, ``allow_external_shards``."""
    from . import shard_learn

    if not isinstance(url, str) or shard_learn.is_pattern(url):
        return _learnt(shard_learn.expanded(url, max_shards), storage_options, timeout, retries, index_dir, options)
    index_url = shard_index.index_url(url)
    try:
        data = listing.read_bytes(index_url, storage_options, timeout=timeout, retries=retries, what="shard index")
    except FileNotFoundError as missing:
        if url.endswith(".json"):
            raise
        urls = _tars_in(url, storage_options, timeout, retries)
        if not urls:
            raise FileNotFoundError(f"{missing}, and no .tar shard directly in {url} to learn one from (its "
                                    "subfolders are not searched: name their shards with a pattern)") from None
        return _learnt(urls, storage_options, timeout, retries, index_dir, options)
    index = json.loads(data)
    other = _other_format(index)
    if other:
        raise ValueError(f"{index_url} is the index of {other[0]}, not of tar shards: read it with {other[1]}")
    return ShardSource(index, posixpath.dirname(index_url), storage_options=storage_options, **options)


def _other_format(index: Any) -> tuple[str, str] | None:
    """(what wrote it, what reads it) for an index.json of MDS shards or litdata chunks."""
    if isinstance(index, dict) and isinstance(index.get("chunks"), list) and isinstance(index.get("config"), dict):
        return "litdata optimize() chunks", "asyncload.litdata(url)"
    shards = index.get("shards") if isinstance(index, dict) else None
    if isinstance(shards, list) and shards and isinstance(shards[0], dict) and shards[0].get("format") == "mds":
        return "MosaicML Streaming MDS shards", "asyncload.mds(url)"
    return None


def _learnt(urls: list[str], storage_options: dict | None, timeout: float | None, retries: int | None,
            index_dir: str | None, options: dict[str, Any]) -> ShardSource:
    """The shard set of ``urls`` from its learnt index (``shard_learn``); its URLs are the ones
    the caller gave, so they are trusted as given."""
    from . import shard_learn

    if not urls:
        raise ValueError("tar_shards: no shard URL given")
    path = shard_learn.index_path(urls, index_dir, options.get("cache_dir"))
    index = shard_learn.learnt_index(urls, path, storage_options, timeout, retries)
    options = {**options, "allow_external_shards": True}
    return ShardSource(index, "", storage_options=storage_options, **options)  # its URLs are whole


def _tars_in(url: str, storage_options: dict | None, timeout: float | None, retries: int | None) -> list[str]:
    """The ``.tar`` files directly in the folder or prefix ``url``, sorted (empty: none, or no
    folder). Not its subfolders: tars found at several levels (a ``val/`` beside ``train/``,
    an old copy) would join one shard set unasked; a pattern names them when they belong."""
    tries = listing.retries_for(retries, storage_options)
    with listing.opened(url, storage_options, timeout) as (fs, root):
        try:
            paths = listing.with_retries(url, "listing", tries, f"{url}: no such folder or prefix",
                                     lambda: fs.find(root, maxdepth=1))
        except FileNotFoundError:
            return []
    root, prefix = root.rstrip("/"), url.rstrip("/")
    return sorted(prefix + path[len(root):] for path in paths if path.endswith(".tar"))
