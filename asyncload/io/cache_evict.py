"""Eviction from the shard cache's folder: the least recently used copies (by the access time the
cache sets at each use) and the files of ours no process needs any more, never a file that is not
the cache's (the names and rules: ``cache_files``)."""

from __future__ import annotations

import os
from pathlib import Path

from .cache_files import OURS, ShardFiles, try_lock, unlink


def _unlink_if_free(names: ShardFiles, *paths: Path) -> bool:
    """Deletes ``paths`` while holding the shard's lock, if no process holds it (no download of
    that shard is under way); True if it did."""
    try:
        fd = try_lock(names.lock)
    except OSError:
        return False
    if fd is None:
        return False
    for path in paths:
        unlink(path)
    os.close(fd)
    return True


def evict(directory: Path, max_bytes: int, keep: set[Path]) -> bool:
    """Deletes the least recently used copies in ``directory`` but ``keep`` until the copies
    and the downloads under way there fit ``max_bytes``, and the files of ours no process needs:
    a killed process's ``.part`` files, meta and lock files of shards no longer kept. Returns
    whether the folder still does not fit."""
    copies, parts, others = [], [], set()
    for entry in os.scandir(directory):
        match = OURS.match(entry.name)
        if match is None or not entry.is_file(follow_symlinks=False):
            continue  # not ours: never counted, never deleted
        try:
            info = entry.stat(follow_symlinks=False)
        except FileNotFoundError:  # another eviction (this process's or another's) took it
            continue
        names, kind, path = ShardFiles(directory, match.group(1), ""), match.group(2), Path(entry.path)
        if kind.startswith("-"):
            copies.append((info.st_atime_ns, info.st_size, path, names))
        elif kind.endswith(".part"):
            parts.append((info.st_size, path, names))
        else:
            others.add(names)
    total = sum(size for size, path, names in parts if not _unlink_if_free(names, path))
    total += sum(size for _, size, _, _ in copies)
    kept = set()
    for _, size, path, names in sorted(copies, key=lambda copy: copy[:2]):
        if total > max_bytes and path not in keep:
            unlink(path)
            unlink(names.meta)
            total -= size
        else:
            kept.add(names)
    for names in others - kept:  # a shard no longer kept: its meta, then its lock
        _unlink_if_free(names, names.meta, names.lock)
    return total > max_bytes


def owned_bytes(directory: Path) -> int:
    """Bytes of the cache's files in ``directory``: its copies and the downloads under way."""
    total = 0
    for entry in os.scandir(directory):
        match = OURS.match(entry.name)
        if match is not None and entry.is_file(follow_symlinks=False):
            try:
                total += entry.stat(follow_symlinks=False).st_size
            except FileNotFoundError:
                pass
    return total
