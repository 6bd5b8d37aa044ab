"""The item cache's files: objects packed into a few append-only segment files, shared by the
processes and users of a node, each object found again by an index every process rebuilds from
the segments themselves (so it survives restarts and needs no file of its own).

Why segments: a file per object (plus its record and its lock) cost the cold epoch more than half
its throughput on small objects (three creates, two renames and a lock per object), and an
eviction that scanned a folder of a million files per evicted copy was quadratic. Here a process
appends the objects it downloaded, a batch at a time (one write, no lock: the segment is its own),
to a segment of its own, ``asyncload-items-<id>.seg`` (``<id>``: its creation time in hex, then
random hex: names sort in the order segments were made), which it holds with an exclusive ``flock``
while it writes it and lets go of (sealed) once it reaches ``segment_bytes`` or the run ends.

A segment starts with ``FILE_MAGIC``; each record is a header (``RECORD``: its magic, the lengths
of the URL and version, the object's size and checksum, and a checksum of the header itself), the
URL, the version (the object's ETag or modification time when it was downloaded), then the object.
A record counts once every byte of it is in the file and its header's checksum holds; a writer
killed mid-batch leaves a torn tail that no process reads past (its segment is never appended to
again). An object's bytes are checked against their checksum at every read (a damaged copy is
downloaded again; 30 us for 100 KB against milliseconds to decode it).

What a process knows (``refresh``): the segments in the folder, read from where it stopped last
time; a segment gone from the folder (another process evicted it) is forgotten, its descriptor
closed once no read uses it. Eviction (``evict``) is one scan of the folder, then whole segments,
least recently used first (the access time, which a read sets at most every ``TOUCH_S`` per
segment and process), deleted while holding their ``flock`` taken without waiting (a segment a
writer still holds is never deleted) and only if they still are what the scan saw and start with
``FILE_MAGIC``: anything else in the folder (a user's file, a symlink, a sub-folder, a file named
like ours with other contents) is neither read past its first bytes, counted, nor deleted. So an
eviction costs one scan and a few deletions per ``segment_bytes``, whatever the number of objects.
"""

from __future__ import annotations

import fcntl
import os
import re
import stat
import struct
import threading
import time
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path

FILE_MAGIC = b"asyncload item segment 1\n"
RECORD = struct.Struct("<4sHHQII")  # magic, URL length, version length, size, object crc32, header crc32
RECORD_MAGIC = b"ALR1"
NAME = re.compile(r"asyncload-items-([0-9a-f]{32})\.seg\Z")
MAX_SEGMENT_BYTES = 64 << 20  # a segment is sealed past this (or an eighth of cache_bytes, if less)
HEADER_READ = 1024  # a record's header is read with this many bytes (its URL and version, mostly)
IOV_MAX = 1024  # the most buffers one pwritev() takes (Linux)
WINDOW_NS = 50_000_000  # a folder time this recent may hide a change in the same tick (local disks: <= 10 ms)
TOUCH_S = 10.0  # a segment's access time is set at most this often per process
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
NEW_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class CopyGone(Exception):
    """The kept copy cannot serve this read (its segment was evicted, or its bytes no longer
    have their checksum): the object is downloaded again."""


@dataclass(frozen=True)
class Entry:
    """Where one object's copy is: its segment, the offset and size of its bytes, their crc32,
    and the version of the object they are."""

    segment: str
    offset: int
    size: int
    crc: int
    version: str


@dataclass
class Segment:
    """A segment this process knows: a read-only descriptor (-1 once closed), how far it has
    been read (``parsed``: records before it are indexed; ``torn``: a record there will never
    complete), and the reads using the descriptor now (it is closed only after them)."""

    path: Path
    fd: int
    inode: int
    parsed: int = len(FILE_MAGIC)
    size: int = 0
    torn: bool = False
    sealed: bool = False  # no writer holds it: it will not grow
    users: int = 0
    gone: bool = False
    touched: float = 0.0


@dataclass
class Writer:
    """This process's segment being written: its descriptor (holding its ``flock``) and end."""

    segment: str
    fd: int
    end: int


class SegmentStore:
    """The segments of one cache folder as this process sees them. Blocking: ``refresh``,
    ``append`` and ``evict`` run one at a time on a thread (the item cache serialises them);
    ``read`` runs on any thread, at the same time as they do."""

    def __init__(self, directory: Path, segment_bytes: int) -> None:
        self.directory = directory
        self.segment_bytes = max(1, min(MAX_SEGMENT_BYTES, segment_bytes))
        self.entries: dict[str, Entry] = {}
        self.segments: dict[str, Segment] = {}
        self.writer: Writer | None = None
        self.total = 0  # the folder's segment bytes at the last scan, plus this process's appends since
        self._lock = threading.Lock()  # segments' users and descriptors, across threads
        self._folder_seen = (-1, 0)  # the folder's modification time at the last scan, and when it ran

    def lookup(self, url: str) -> Entry | None:
        """The indexed copy of ``url`` in a segment still there, or None."""
        entry = self.entries.get(url)
        if entry is None:
            return None
        segment = self.segments.get(entry.segment)
        return entry if segment is not None and not segment.gone else None

    def forget(self, url: str, entry: Entry) -> None:
        """Drops ``url``'s entry if it still is ``entry`` (a copy found damaged, or gone)."""
        if self.entries.get(url) is entry:
            del self.entries[url]

    def read(self, entry: Entry) -> bytes:
        """The copy's bytes, checked against their checksum; ``CopyGone`` if it cannot serve."""
        with self._lock:
            segment = self.segments.get(entry.segment)
            if segment is None or segment.fd < 0:
                raise CopyGone(f"segment {entry.segment} is no longer kept")
            segment.users += 1
        try:
            data = os.pread(segment.fd, entry.size, entry.offset)
        finally:
            with self._lock:
                segment.users -= 1
                self._close_if_unused(segment)
        if len(data) != entry.size or zlib.crc32(data) != entry.crc:
            raise CopyGone(f"the copy in {segment.path.name} at {entry.offset} does not hold what was downloaded")
        now = time.monotonic()
        if now - segment.touched > TOUCH_S:  # least recently used: the access time, set now and then
            segment.touched = now
            try:
                os.utime(segment.fd, ns=(time.time_ns(), os.fstat(segment.fd).st_mtime_ns))
            except OSError:
                pass  # another user's segment, readable but not ours to mark: it only ages
        return data

    def refresh(self) -> None:
        """Indexes what the other processes (and runs) have written since the last refresh, and
        forgets the segments they evicted (see the module). The folder is scanned only when its
        names may have changed (its modification time moved, or was too recent to tell:
        ``WINDOW_NS``); else only the segments peers still write are looked at (one ``fstat``)."""
        folder = os.stat(self.directory)
        now = time.time_ns()
        seen, scanned = self._folder_seen
        if folder.st_mtime_ns != seen or (scanned - seen < WINDOW_NS <= now - seen):
            self._full_refresh()
            self._folder_seen = (folder.st_mtime_ns, now)
            return
        own = self.writer.segment if self.writer is not None else None
        for name, segment in list(self.segments.items()):
            if name != own and not segment.sealed and segment.fd >= 0:
                self._follow(name, segment, os.fstat(segment.fd).st_size)

    def quiet(self) -> bool:
        """Whether a ``refresh`` now would find nothing new: the folder's names cannot have
        changed since the last scan (its modification time is the one seen, and was old enough
        then to tell) and no other process still writes a segment this process knows."""
        writer = self.writer
        own = writer.segment if writer is not None else None
        # a copy (one C call under the GIL): the disk thread may add or drop segments meanwhile
        if any(not segment.sealed and name != own for name, segment in list(self.segments.items())):
            return False
        seen, scanned = self._folder_seen
        return os.stat(self.directory).st_mtime_ns == seen and scanned - seen >= WINDOW_NS

    def _follow(self, name: str, segment: Segment, size: int) -> None:
        """Indexes a peer's segment up to ``size``; notes it sealed once no writer holds it."""
        if not segment.sealed:
            try:
                fcntl.flock(segment.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # its writer took LOCK_EX before its magic
            except BlockingIOError:
                pass
            else:
                fcntl.flock(segment.fd, fcntl.LOCK_UN)
                segment.sealed = True
                size = os.fstat(segment.fd).st_size  # all it will ever hold
        if not segment.torn and size > segment.parsed:
            self._parse(name, segment, size)

    def _full_refresh(self) -> None:
        found = self._scan()
        # oldest first (a name starts with its creation time): of two records of one URL (a copy
        # downloaded again), the newer is kept
        for name, (path, info) in sorted(found.items()):
            segment = self.segments.get(name)
            if segment is not None and segment.inode != info.st_ino:
                self._drop(name)
                segment = None
            if segment is None:
                segment = self._open(name, path, info)
                if segment is None:
                    continue
            if self.writer is None or name != self.writer.segment:
                self._follow(name, segment, info.st_size)
        self.total = sum(found[name][1].st_size for name in list(self.segments) if name in found)
        for name in [name for name in self.segments if name not in found]:
            self._drop(name)

    def append(self, objects: list[tuple[str, str, bytes]]) -> list[tuple[str, Entry]]:
        """Writes ``(url, version, bytes)`` objects at the end of this process's segment (a new
        one if it has none or it is full) in one write; returns their entries (indexed too).
        An ``OSError`` (a full disk) leaves the segment as it was before the write."""
        if self.writer is None or self.writer.end >= self.segment_bytes:
            self.seal()
            self._start_segment()
        writer = self.writer
        assert writer is not None
        pieces, entries, offset = [], [], writer.end
        for url, version, data in objects:
            url_bytes, version_bytes = url.encode(), version.encode()
            crc = zlib.crc32(data)
            head = RECORD.pack(RECORD_MAGIC, len(url_bytes), len(version_bytes), len(data), crc, 0)
            head = head[:-4] + struct.pack("<I", zlib.crc32(url_bytes + version_bytes, zlib.crc32(head[:-4])))
            pieces += [head, url_bytes, version_bytes, data]
            offset += len(head) + len(url_bytes) + len(version_bytes)
            entries.append((url, Entry(writer.segment, offset, len(data), crc, version)))
            offset += len(data)
        try:
            _write_pieces(writer.fd, pieces, writer.end)
        except OSError:
            try:
                os.ftruncate(writer.fd, writer.end)
            except OSError:
                pass
            raise
        self.total += offset - writer.end
        writer.end = offset
        segment = self.segments[writer.segment]
        segment.parsed = segment.size = offset
        for url, entry in entries:
            self.entries[url] = entry
        return entries

    def seal(self) -> None:
        """Lets go of this process's segment: no more is written to it, any process may evict it."""
        if self.writer is not None:
            os.close(self.writer.fd)  # also releases its flock
            segment = self.segments.get(self.writer.segment)
            if segment is not None:
                segment.sealed = True
            self.writer = None

    def evict(self, target: int) -> int:
        """Deletes whole segments, least recently used first, until the folder's segments fit
        ``target`` bytes (see the module; one scan); returns the bytes left."""
        found = self._scan()
        candidates, total = [], 0
        for name, (path, info) in found.items():
            segment = self.segments.get(name)
            if segment is not None and segment.inode != info.st_ino:
                self._drop(name)  # replaced since: another file now
                segment = None
            if segment is None:
                segment = self._open(name, path, info)  # indexed at the next refresh
            if segment is None:
                continue  # not ours (no FILE_MAGIC), or not yet: neither counted nor deleted
            total += info.st_size
            candidates.append((info.st_atime_ns, name, path, info))
        candidates.sort(key=lambda candidate: candidate[:2])
        for _, name, path, info in candidates:
            if total <= target:
                break
            if self.writer is not None and name == self.writer.segment:
                continue
            if _delete_if_free(path, info):
                total -= info.st_size
                self._drop(name)
        self.total = total
        return total

    def close(self) -> None:
        self.seal()
        with self._lock:
            for segment in self.segments.values():
                segment.gone = True
                self._close_if_unused(segment)

    def _scan(self) -> dict[str, tuple[Path, os.stat_result]]:
        """One scan of the folder: the regular files named as segments, with their status."""
        found = {}
        with os.scandir(self.directory) as entries:
            for entry in entries:
                match = NAME.match(entry.name)
                if match is None:
                    continue
                try:
                    info = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(info.st_mode):
                    found[match.group(1)] = (Path(entry.path), info)
        return found

    def _open(self, name: str, path: Path, info: os.stat_result) -> Segment | None:
        """A read descriptor of the segment at ``path`` if it still is what the scan saw and
        starts with ``FILE_MAGIC`` (else it is not ours, or not yet: looked at again later)."""
        try:
            fd = os.open(path, READ_FLAGS)
        except OSError:
            return None
        try:
            now = os.fstat(fd)
            if now.st_ino != info.st_ino or not stat.S_ISREG(now.st_mode) \
                    or os.pread(fd, len(FILE_MAGIC), 0) != FILE_MAGIC:
                os.close(fd)
                return None
        except OSError:
            os.close(fd)
            return None
        segment = self.segments[name] = Segment(path, fd, info.st_ino)
        return segment

    def _parse(self, name: str, segment: Segment, size: int) -> None:
        """Indexes the complete records of ``segment`` from where it stopped up to ``size``."""
        at = segment.parsed
        while at + RECORD.size <= size:
            try:
                head = os.pread(segment.fd, HEADER_READ, at)
            except OSError:
                return
            if len(head) < RECORD.size:
                break
            magic, url_length, version_length, length, crc, head_crc = RECORD.unpack_from(head)
            texts = at + RECORD.size + url_length + version_length
            if magic != RECORD_MAGIC:
                segment.torn = True
                break
            if texts > at + len(head):
                head = os.pread(segment.fd, texts - at, at)
                if len(head) < texts - at:
                    break
            names = head[RECORD.size:texts - at]
            if zlib.crc32(names, zlib.crc32(head[:RECORD.size - 4])) != head_crc:
                segment.torn = True  # a torn tail (or not a record at all): never read past
                break
            if texts + length > size:
                break  # not all written yet
            url, version = names[:url_length].decode(), names[url_length:].decode()
            self.entries[url] = Entry(name, texts, length, crc, version)
            at = texts + length
        segment.parsed = at
        segment.size = size

    def _drop(self, name: str) -> None:
        with self._lock:
            segment = self.segments.pop(name, None)
            if segment is not None:
                segment.gone = True
                self._close_if_unused(segment)

    def _close_if_unused(self, segment: Segment) -> None:
        if segment.gone and not segment.users and segment.fd >= 0:
            os.close(segment.fd)
            segment.fd = -1

    def _start_segment(self) -> None:
        name = f"{time.time_ns():016x}{uuid.uuid4().hex[:16]}"  # sorts by creation time
        path = self.directory / f"asyncload-items-{name}.seg"
        fd = os.open(path, NEW_FLAGS, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new name: nobody else holds it
            os.pwrite(fd, FILE_MAGIC, 0)
            read_fd = os.open(path, READ_FLAGS)
        except OSError:
            os.close(fd)
            _unlink(path)
            raise
        self.segments[name] = Segment(path, read_fd, os.fstat(read_fd).st_ino, size=len(FILE_MAGIC))
        self.writer = Writer(name, fd, len(FILE_MAGIC))
        self.total += len(FILE_MAGIC)


def _write_pieces(fd: int, pieces: list[bytes], at: int) -> None:
    """Writes ``pieces`` one after the other from offset ``at``, with as few ``pwritev`` calls as
    the kernel takes (joining them first cost more CPU than the write: a copy of every object)."""
    views = [memoryview(piece) for piece in pieces if piece]
    while views:
        written = os.pwritev(fd, views[:IOV_MAX], at)
        at += written
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]


def _delete_if_free(path: Path, info: os.stat_result) -> bool:
    """Deletes the segment at ``path`` if it still is the file the scan saw, starts with
    ``FILE_MAGIC`` and no writer holds its ``flock``; True if it did."""
    try:
        fd = os.open(path, READ_FLAGS)
    except OSError:
        return False
    try:
        now = os.fstat(fd)
        if now.st_ino != info.st_ino or not stat.S_ISREG(now.st_mode) or os.pread(fd, len(FILE_MAGIC), 0) != FILE_MAGIC:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a writer holds it
        try:
            if os.lstat(path).st_ino != info.st_ino:
                return False
        except FileNotFoundError:
            return False
        return _unlink(path)
    except OSError:
        return False
    finally:
        os.close(fd)


def _unlink(path: Path) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:  # gone, or another user's file in a sticky folder: it ages out by them
        return False


def owned_bytes(directory: Path) -> int:
    """The bytes of the segments in ``directory`` (for the default budget's rule)."""
    total = 0
    with os.scandir(directory) as entries:
        for entry in entries:
            if NAME.match(entry.name) is not None:
                try:
                    info = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(info.st_mode):
                    total += info.st_size
    return total
