"""Eviction from the shard cache's folder: the least recently used copies (by the access time the
cache sets at each use) and the files of ours no process needs any more, never a file that is not
the cache's (the names and rules: ``files``). A file is deleted only while this process holds
its shard's lock, taken without waiting (a shard a peer is downloading is left alone), and only if
it is still what the scan saw: a peer that installs a copy between the scan and the deletion
keeps its fresh copy and meta (they were downloaded again)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from .files import OURS, ShardFiles, read_meta, shard_files, try_lock, unlink

DEFAULT_CAP = 64 << 30  # cache_bytes=None: at most this...
FREE_FRACTION = 0.5  # ...and at most this fraction of the disk's free space plus what the cache keeps


def _unlink_if_free(names: ShardFiles, *paths: Path, still: Callable[[], bool] = lambda: True) -> bool:
    """Deletes ``paths`` while holding the shard's lock, if no process holds it (no download of
    that shard is under way) and ``still()`` holds under the lock (what the scan saw is what is
    there: a peer did not install a copy since); True if it did."""
    try:
        fd = try_lock(names.lock)
    except OSError:
        return False
    if fd is None:
        return False
    try:
        if not still():
            return False
        for path in paths:
            unlink(path)
        return True
    finally:
        os.close(fd)


def _inode(path: Path) -> int | None:
    try:
        return os.lstat(path).st_ino
    except OSError:
        return None


def _copy_of(names: ShardFiles) -> bool:
    """Whether a copy of ``names``' shard is in the folder now, as its meta file names it (a copy
    without its meta is of no use: ``current`` refuses it). No scan: a scan per meta file made
    an eviction quadratic in the folder's files."""
    meta = read_meta(names.meta)
    url = None if meta is None else meta.get("url")
    if not isinstance(url, str):
        return False
    try:
        os.lstat(shard_files(names.directory, url).shard)
    except OSError:
        return False
    return True


def evict(directory: Path, max_bytes: int, keep: set[Path]) -> bool:
    """Deletes the least recently used copies in ``directory`` but ``keep`` until the copies
    and the downloads under way there fit ``max_bytes``, and the files of ours no process needs:
    a killed process's ``.part`` files, meta and lock files of shards no longer kept. Returns
    whether the folder still does not fit."""
    return evict_to(directory, max_bytes, max_bytes, keep)[1]


def evict_to(directory: Path, target: int, max_bytes: int, keep: set[Path]) -> tuple[int, bool]:
    """``evict``, down to ``target`` bytes (one scan of the folder, closed); returns the bytes
    left and whether they pass ``max_bytes``."""
    copies, parts, others = [], [], set()
    with os.scandir(directory) as entries:
        for entry in entries:
            match = OURS.match(entry.name)
            if match is None or not entry.is_file(follow_symlinks=False):
                continue  # not ours: never counted, never deleted
            try:
                info = entry.stat(follow_symlinks=False)
            except FileNotFoundError:  # another eviction (this process's or another's) took it
                continue
            names, kind, path = ShardFiles(directory, match.group(1), ""), match.group(2), Path(entry.path)
            if kind.startswith("-"):
                copies.append((info.st_atime_ns, info.st_size, path, names, info.st_ino))
            elif kind.endswith(".part"):
                parts.append((info.st_size, path, names))
            else:
                others.add(names)
    total = sum(size for size, path, names in parts if not _unlink_if_free(names, path))
    total += sum(copy[1] for copy in copies)
    kept = set()
    for _, size, path, names, inode in sorted(copies, key=lambda copy: copy[:2]):
        if total > target and path not in keep and _unlink_if_free(
                names, path, names.meta, still=lambda: _inode(path) == inode):
            total -= size
        else:
            kept.add(names)
    for names in others - kept:  # a shard no longer kept: its meta, then its lock
        _unlink_if_free(names, names.meta, names.lock, still=lambda: not _copy_of(names))
    return total, total > max_bytes


def owned_bytes(directory: Path) -> int:
    """Bytes of the cache's files in ``directory``: its copies and the downloads under way."""
    total = 0
    with os.scandir(directory) as entries:
        for entry in entries:
            match = OURS.match(entry.name)
            if match is not None and entry.is_file(follow_symlinks=False):
                try:
                    total += entry.stat(follow_symlinks=False).st_size
                except FileNotFoundError:
                    pass
    return total


def default_budget(directory: Path) -> int:
    """``DEFAULT_CAP``, or less: ``FREE_FRACTION`` of what the disk has free plus what the cache
    keeps already (a shared node's disk is not the cache's alone)."""
    disk = os.statvfs(directory)
    return min(DEFAULT_CAP, int(FREE_FRACTION * (disk.f_bavail * disk.f_frsize + owned_bytes(directory))))
