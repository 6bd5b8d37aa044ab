"""The shard cache's files, and the rules that make a folder shared by a node's users safe.

The cache touches only what it wrote. Its names are ``asyncload-<hash>...`` (the hash: of the
shard's URL, so every process finds the same file), one set per shard:

- ``asyncload-<hash>-<name>``: the shard, whole (``<name>``: the end of its URL's file name, at
  most ``READABLE_CHARS`` characters of ``[A-Za-z0-9._-]``, so any URL fits a file name);
- ``asyncload-<hash>.meta``: JSON ``{url, size, version, crc32}`` recorded at download;
- ``asyncload-<hash>.lock``: the ``flock`` one downloader holds (its modification time is the
  downloader's heartbeat, touched from a timer while it holds it: ``lock``);
- ``asyncload-<hash>.<id>.part``: a download (or a meta file) being written, renamed into place.

Anything else in the folder (a user's file, a sub-folder, a symlink) is neither read, counted nor
deleted, and a name of ours that is not a regular file is never followed or read (``O_NOFOLLOW``,
``lstat``, and a non-blocking open: a planted FIFO cannot stall a read). Files are created with
mode 0666 less the user's umask, so users who share a group-writable folder with umask 002 can
replace each other's shards. Least recently used means the access time, which the cache sets
itself at each use; the modification time stays the download's, so a copy rewritten in place is
noticed by the once-per-process content check (``current``). A copy damaged after that check is
found when one of its samples fails to decode (``recheck``).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import posixpath
import re
import stat
import time
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PREFIX = "asyncload-"
READABLE_CHARS = 80  # with the prefix, hash and a part's id: ~150 of the 255 bytes a name may have
OURS = re.compile(r"asyncload-([0-9a-f]{16})(-[A-Za-z0-9._-]*|\.lock|\.meta|\.[0-9a-f]{32}\.part)\Z")
META_MAX_BYTES = 1 << 16
CHECK_BLOCK = 8 << 20
WRITE_PIECE = 1 << 20  # the most one write() call writes (see ``write_all``)
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
NEW_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)

CopyId = tuple[int, int, int]  # a kept copy's (device, inode, modification time): which file a read came from

# The copies this process has read whole and found equal to their recorded checksum, with the
# (size, crc32) they had: checked once per process and copy, not per read (``recheck`` forgets one).
_checked_copies: dict[CopyId, tuple[int, int]] = {}


@dataclass(frozen=True)
class ShardFiles:
    """The cache's names for one shard (see the module)."""

    directory: Path
    digest: str
    readable: str

    @property
    def shard(self) -> Path:
        return self.directory / f"{PREFIX}{self.digest}-{self.readable}"

    @property
    def lock(self) -> Path:
        return self.directory / f"{PREFIX}{self.digest}.lock"

    @property
    def meta(self) -> Path:
        return self.directory / f"{PREFIX}{self.digest}.meta"

    def new_part(self) -> Path:
        return self.directory / f"{PREFIX}{self.digest}.{uuid.uuid4().hex}.part"


def shard_files(directory: Path, url: str) -> ShardFiles:
    digest = hashlib.sha1(url.encode()).hexdigest()[:16]
    readable = re.sub(r"[^A-Za-z0-9._-]", "_", posixpath.basename(url.rstrip("/")))[-READABLE_CHARS:]
    return ShardFiles(directory, digest, readable)


def open_copy(path: Path, size: int) -> int:
    """A read-only descriptor of ``path`` if it is a regular file of ``size`` bytes; else
    FileNotFoundError (a name of ours holding something else is as good as no copy)."""
    try:
        fd = os.open(path, READ_FLAGS)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):  # a symlink, a socket, a folder
            raise FileNotFoundError(errno.ENOENT, f"not a cache file: {error}", str(path)) from None
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_size != size:
        os.close(fd)
        raise FileNotFoundError(errno.ENOENT, f"not a {size}-byte regular file", str(path))
    return fd


def read_copy_range(path: Path, start: int, end: int, size: int) -> tuple[bytes, CopyId]:
    """Bytes ``[start, end)`` of the copy at ``path``, and which copy they came from."""
    fd = open_copy(path, size)
    try:
        return os.pread(fd, end - start, start), copy_id(os.fstat(fd))
    finally:
        os.close(fd)


def read_checked_range(path: Path, start: int, end: int, size: int) -> tuple[bytes, CopyId] | None:
    """Bytes ``[start, end)`` of the copy at ``path`` and which copy it is, if this process has
    checked that copy whole (``current``: its checksum held); None if the file there is another
    one since (replaced: ``read_copy_range``, through the cache's checks, serves it);
    FileNotFoundError if it is gone. For decode threads: one open, fstat and pread."""
    fd = open_copy(path, size)
    try:
        copy = copy_id(os.fstat(fd))
        checked = _checked_copies.get(copy)
        if checked is None or checked[0] != size:
            return None
        return os.pread(fd, end - start, start), copy
    finally:
        os.close(fd)


def is_checked(path: Path, size: int) -> bool:
    """Whether the file at ``path`` now is a ``size``-byte copy this process checked whole."""
    try:
        info = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    checked = _checked_copies.get(copy_id(info))
    return checked is not None and checked[0] == size


def copy_id(info: os.stat_result) -> CopyId:
    return info.st_dev, info.st_ino, info.st_mtime_ns


def touch(path: Path, size: int) -> bool:
    """Marks the copy at ``path`` used now (its access time); False if it is gone (another
    process may evict it at any moment: no exists-then-use) or not a ``size``-byte file."""
    try:
        info = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(info.st_mode) or info.st_size != size:
        return False
    try:
        os.utime(path, ns=(time.time_ns(), info.st_mtime_ns), follow_symlinks=False)
    except OSError:
        pass  # another user's copy we may read but not mark: it only ages
    return True


def read_meta(path: Path) -> dict[str, Any] | None:
    try:
        fd = os.open(path, READ_FLAGS)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        meta = json.loads(os.pread(fd, META_MAX_BYTES, 0))
        return meta if isinstance(meta, dict) else None
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def current(files: ShardFiles, url: str, size: int, version: str | None) -> bool:
    """Whether the kept copy is ``url``'s ``size`` bytes at ``version`` (None: storage could not
    be asked, any recorded version will do) and its bytes still have the checksum recorded at
    download (read whole once per process and copy: a copy damaged on disk is not served)."""
    meta = read_meta(files.meta)
    if meta is None or meta.get("url") != url or meta.get("size") != size or not isinstance(meta.get("crc32"), int):
        return False
    if version is not None and meta.get("version") != version:
        return False
    try:
        fd = open_copy(files.shard, size)
    except OSError:
        return False
    try:
        key = copy_id(os.fstat(fd))
        if _checked_copies.get(key) == (size, meta["crc32"]):
            return True
        if checksum(fd, size) != meta["crc32"]:
            return False
        _checked_copies[key] = (size, meta["crc32"])
        return True
    finally:
        os.close(fd)


def checksum(fd: int, size: int) -> int:
    crc = 0
    for start in range(0, size, CHECK_BLOCK):
        crc = zlib.crc32(os.pread(fd, min(CHECK_BLOCK, size - start), start), crc)
    return crc


def recheck(files: ShardFiles, size: int, copy: CopyId) -> bool:
    """Whether bytes read from ``copy`` may be read again better: True if the kept copy is no
    longer that one (replaced or evicted, by this process or another), or if it no longer has its
    recorded checksum (damaged after ``current`` checked it, or in a way that check could not
    see, such as bit rot that keeps the modification time): then it is deleted and forgotten, so
    the next read downloads it again. False: the copy is what was downloaded (the object is bad)."""
    try:
        fd = open_copy(files.shard, size)
    except OSError:
        return True
    try:
        if copy_id(os.fstat(fd)) != copy:
            return True
        meta = read_meta(files.meta)
        if meta is not None and meta.get("size") == size and meta.get("crc32") == checksum(fd, size):
            return False
    finally:
        os.close(fd)
    _checked_copies.pop(copy, None)
    unlink(files.shard)  # a peer's fresh copy renamed in meanwhile goes too: it is downloaded again
    unlink(files.meta)
    return True


def try_lock(path: Path) -> int | None:
    """A descriptor holding ``path``'s exclusive ``flock``, or None while another process holds
    it. Opened read-only (another user's lock file is locked as well as ours); a lock file an
    eviction deleted between our open and our lock is opened again."""
    for _ in range(3):
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            if os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)
    return None


def heartbeat(fd: int) -> None:
    """Tells the processes waiting on this lock that its holder is alive (see ``last_beat``)."""
    try:
        os.utime(fd)
    except OSError:
        pass  # another user's lock file: they wait for the read timeout, then read storage


def last_beat(path: Path) -> int | None:
    try:
        return os.stat(path, follow_symlinks=False).st_mtime_ns
    except OSError:
        return None


def new_file(path: Path) -> int:
    """A new file for writing (mode 0666 less the umask; never an existing name or a symlink)."""
    return os.open(path, NEW_FLAGS, 0o666)


def reserve(fd: int, size: int) -> None:
    """Allocates ``size`` bytes for a download before it is written: one extent, so the writes
    that follow cost the kernel a tenth of the CPU (measured: 0.05 s against 0.4-0.8 s for
    416 MB on ext4, which the decode threads of a cold epoch need), and a full disk is found
    before the download, not at its end. A file system that cannot is written as it comes."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as error:
        if error.errno in DISK_FULL:
            raise
    except AttributeError:  # no posix_fallocate on this platform
        pass


def write_all(fd: int, data: bytes, crc: int) -> int:
    """Writes ``data`` at the end of ``fd``, ``WRITE_PIECE`` bytes a call (one write of 16 MB
    costs the kernel several times the CPU of sixteen of 1 MB); returns the checksum so far
    with ``data``."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view[:WRITE_PIECE]):]
    return zlib.crc32(data, crc)


def write_new(path: Path, data: bytes) -> int:
    """``data`` as the new file ``path``; returns its checksum."""
    fd = new_file(path)
    try:
        return write_all(fd, data, 0)
    finally:
        os.close(fd)


def install(files: ShardFiles, partial: Path, meta: dict[str, Any]) -> None:
    """Renames the downloaded ``partial`` into place, then its meta file (written whole, then
    renamed: a reader sees an old or a new one, never half; one that does not match the copy
    beside it fails ``current``'s checksum and the copy is downloaded again)."""
    meta_part = files.new_part()
    try:
        fd = new_file(meta_part)
        try:
            write_all(fd, json.dumps(meta).encode(), 0)
        finally:
            os.close(fd)
        downloaded = copy_id(os.lstat(partial))  # a rename keeps the inode and times
        os.replace(partial, files.shard)
        os.replace(meta_part, files.meta)
        _checked_copies[downloaded] = (meta["size"], meta["crc32"])  # its checksum was taken as it was written
    finally:
        unlink(meta_part)


def unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:  # gone, or another user's file in a sticky folder: it ages out by them
        pass
