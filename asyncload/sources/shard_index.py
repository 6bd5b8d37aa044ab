"""A tar shard set's ``index.json``, flattened into arrays and checked before anything is read.

An index is data from wherever it was found, so it is checked as input: a shard's URL must lie in
the index's own folder (a URL of another protocol, an absolute path or one that climbs out with
``..`` could point a loader at any file it can read) unless the caller trusts the index
(``allow_external_shards``); every member's byte range must lie in its shard, after a tar header,
and not overlap another member's. A bad entry raises ValueError naming the shard, the sample and
the field, once, at construction, instead of odd reads (or gigabytes of them) later.
"""

from __future__ import annotations

import posixpath
from typing import Any

import numpy as np

from ..redact import shown

INDEX_NAME = "index.json"  # the index beside a shard set's shards (asyncload's, MDS's, litdata's)
INDEX_FORMAT = "asyncload-shards/1"  # the "format" of an index written by write_shards / index_shards
TAR_HEADER = 512  # every tar member's data follows a header of this size
MAX_SHARD_BYTES = 1 << 40  # 1 TiB: no shard is larger; a larger "bytes" is a corrupt or hostile index


def index_url(url: str) -> str:
    """The index a source's ``url`` names: itself when it ends in ``.json``, else the
    ``index.json`` in that folder or bucket prefix."""
    return url if url.endswith(".json") else posixpath.join(url.rstrip("/"), INDEX_NAME)


def shard_url(base_url: str, url: Any, number: int, allow_external: bool, field: str = "url") -> str:
    """Shard ``number``'s URL from the index (its ``field``): a path relative to the index's
    folder ``base_url``, within it; another protocol, an absolute path or ``..`` out of the
    folder only with ``allow_external`` (``tar_shards``'s; MDS and litdata indexes never)."""
    trust = "; pass tar_shards(..., allow_external_shards=True) if you trust this index" if field == "url" else ""
    if not isinstance(url, str) or not url:
        raise index_error(base_url, number, None, field, f"must be a non-empty string, got {shown(url, 80)}")
    if "://" in url or "::" in url or url.startswith("/"):
        if allow_external:
            return url
        why = "another location" if url.startswith("/") else "another protocol or store"
        raise index_error(base_url, number, None, field, f"{shown(url, 80)} points to {why}, outside the index's folder{trust}")
    relative = posixpath.normpath(url)
    if relative == ".." or relative.startswith("../"):
        if not allow_external:
            raise index_error(base_url, number, None, field, f"{shown(url, 80)} climbs out of the index's folder{trust}")
    return posixpath.join(base_url, url)


def flatten(shards: Any, base_url: str, allow_external: bool) -> dict[str, Any]:
    """The index's shards as arrays (a million samples cost tens of MB, not a GB of objects):
    ``urls``, ``shard_bytes``, ``counts`` (samples per shard), ``keys``, ``labels`` (a list, None
    for a sample without one), ``member_start``/``ext``/``offset``/``size`` and the extensions;
    checked as the module says."""
    if not isinstance(shards, list):
        raise ValueError(f"{base_url}: index field 'shards' must be a list, got {shown(shards, 80)}")
    urls, shard_bytes, counts, keys, labels = [], [], [], [], []
    ext_ids: dict[str, int] = {}
    member_start, member_ext, member_offset, member_size = [0], [], [], []
    for number, shard in enumerate(shards):
        if not isinstance(shard, dict):
            raise index_error(base_url, number, None, "shard", f"must be an object, got {shown(shard, 80)}")
        urls.append(shard_url(base_url, shard.get("url"), number, allow_external))
        size = shard.get("bytes")
        if not is_int(size) or not 0 <= size <= MAX_SHARD_BYTES:
            raise index_error(base_url, number, None, "bytes", f"must be an integer in [0, 2**40], got {shown(size, 80)}")
        shard_bytes.append(size)
        shard_keys, members, shard_labels = shard.get("keys"), shard.get("members"), shard.get("labels")
        if not isinstance(shard_keys, list) or not all(isinstance(key, str) for key in shard_keys):
            raise index_error(base_url, number, None, "keys", "must be a list of strings")
        if not isinstance(members, list) or len(members) != len(shard_keys):
            raise index_error(base_url, number, None, "members", f"must be a list of one entry per key ({len(shard_keys)})")
        if shard_labels is not None and (not isinstance(shard_labels, list) or len(shard_labels) != len(shard_keys)
                                         or not all(label is None or is_int(label) for label in shard_labels)):
            raise index_error(base_url, number, None, "labels", "must be null or a list of one integer (or null) per key")
        counts.append(len(shard_keys))
        keys.extend(shard_keys)
        labels.extend(shard_labels or [None] * len(shard_keys))
        for sample, entry in enumerate(members):
            if not isinstance(entry, list) or not entry:
                raise index_error(base_url, number, sample, "members", f"must be a non-empty list, got {shown(entry, 80)}")
            for member in entry:
                if not (isinstance(member, list) and len(member) == 3 and isinstance(member[0], str)):
                    raise index_error(base_url, number, sample, "members", f"each must be [extension, offset, size], got {shown(member, 80)}")
                ext, offset, size = member
                if not is_int(offset) or not is_int(size):
                    raise index_error(base_url, number, sample, "offset" if not is_int(offset) else "size",
                               f"must be an integer, got {shown(offset if not is_int(offset) else size, 80)}")
                member_ext.append(ext_ids.setdefault(ext, len(ext_ids)))
                member_offset.append(offset)
                member_size.append(size)
            member_start.append(len(member_ext))
    flat = {
        "urls": urls, "shard_bytes": np.array(shard_bytes, dtype=np.int64), "counts": counts, "keys": keys,
        "labels": labels, "extensions": list(ext_ids),
        "member_start": np.array(member_start, dtype=np.int64), "member_ext": np.array(member_ext, dtype=np.int16),
        "member_offset": _int64(member_offset), "member_size": _int64(member_size),
    }
    _check_ranges(flat, base_url)
    return flat


def _check_ranges(flat: dict[str, Any], base_url: str) -> None:
    """Every member's bytes inside its shard, after a tar header, clear of the other members'
    (with a header between): vectorised, a million members in milliseconds."""
    offset, size, start = flat["member_offset"], flat["member_size"], flat["member_start"]
    if not len(offset):
        return
    sample_of = np.repeat(np.arange(len(start) - 1), np.diff(start))
    shard_of = np.repeat(np.arange(len(flat["counts"])), flat["counts"])[sample_of]
    shard_end = flat["shard_bytes"][shard_of]

    def fail_at(bad: np.ndarray, field: str, what: str) -> None:
        if bad.any():
            m = int(np.argmax(bad))
            sample, shard = int(sample_of[m]), int(shard_of[m])
            in_shard = sample - int(np.sum(flat["counts"][:shard]))
            raise index_error(base_url, shard, in_shard, field, f"of member {int(m - start[sample])} "
                       f"(offset {int(offset[m])}, size {int(size[m])}) {what}")

    fail_at(offset < TAR_HEADER, "offset", "is before the end of the first tar header (512)")
    fail_at(size < 0, "size", "is negative")
    fail_at((offset > shard_end) | (size > shard_end), "size", "runs past the shard's end (its 'bytes')")
    end = offset + size  # both at most 2**40 now: no overflow
    fail_at(end > shard_end, "size", "runs past the shard's end (its 'bytes')")
    order = np.lexsort((offset, shard_of))
    same_shard = shard_of[order][1:] == shard_of[order][:-1]
    overlap = np.zeros(len(offset), dtype=bool)
    overlap[order[1:]] = same_shard & (offset[order][1:] < end[order][:-1] + TAR_HEADER)
    fail_at(overlap, "offset", "overlaps another member or its tar header")


def _int64(values: list[int]) -> np.ndarray:
    try:
        return np.array(values, dtype=np.int64)
    except OverflowError:
        raise ValueError(f"an index offset or size does not fit 64 bits: {shown(max(values, key=abs), 80)}") from None


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def index_error(base_url: str, shard: int, sample: int | None, field: str, what: str) -> ValueError:
    where = f"shard {shard}" + (f", sample {sample}" if sample is not None else "")
    return ValueError(f"shard index of {base_url}: {where}: field '{field}' {what}")
