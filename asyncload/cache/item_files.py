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
time; a segment gone from the folder (another process evicted it) is forgotten with its entries,
its descriptor closed once no read uses it. Descriptors are opened on demand and at most
``MAX_OPEN`` are kept (least recently used closed first): a descriptor per segment was a thousand
per process at the default budget, the usual limit, and past it segments went unindexed and
uncounted. A segment opened again must be the file first seen (its inode): one replaced or evicted
in between is not read as the old one. Sizes come from the scans, not from open descriptors. Eviction (``evict``) is one scan of the folder, then whole segments,
least recently used first (the access time, which a read sets at most every ``TOUCH_S`` per
segment and process), deleted while holding their ``flock`` taken without waiting (a segment a
writer still holds is never deleted) and only if they still are what the scan saw and start with
``FILE_MAGIC``: anything else in the folder (a user's file, a symlink, a sub-folder, a file named
like ours with other contents) is neither read past its first bytes, counted, nor deleted. So an
eviction costs one scan and a few deletions per ``segment_bytes``, whatever the number of objects.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import stat
import struct
import threading
import time
import uuid
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
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
MAX_OPEN = 64  # read descriptors kept open per store (more only while that many reads run at once)


class CopyGone(Exception):
    """The kept copy cannot serve this read (its segment was evicted, or its bytes no longer
    have their checksum): the object is downloaded again."""


@dataclass(frozen=True, slots=True)
class Entry:
    """Where one object's copy is: its segment, the offset and size of its bytes, their crc32,
    and the version of the object they are. Slotted: a million of them are indexed per process."""

    segment: str
    offset: int
    size: int
    crc: int
    version: str


@dataclass(eq=False)
class Segment:
    """A segment this process knows: the file first seen (``inode``), its read-only descriptor
    while one is open (-1 else: opened on demand), how far it has been read (``parsed``: records
    before it are indexed; ``torn``: a record there will never complete), the reads using the
    descriptor now (it is closed only after them), and the URLs indexed from it (pruned with it)."""

    path: Path
    inode: int
    fd: int = -1
    parsed: int = len(FILE_MAGIC)
    size: int = 0
    torn: bool = False
    sealed: bool = False  # no writer holds it: it will not grow
    users: int = 0
    gone: bool = False
    touched: float = 0.0
    urls: list[str] = field(default_factory=list)


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
        self._open_fds: OrderedDict[Segment, None] = OrderedDict()  # segments with a descriptor, least recent first
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
        segment = self.segments.get(entry.segment)
        if segment is None:
            raise CopyGone(f"segment {entry.segment} is no longer kept")
        fd = self._acquire(segment)
        try:
            data = os.pread(fd, entry.size, entry.offset)
            if len(data) != entry.size or zlib.crc32(data) != entry.crc:
                raise CopyGone(f"the copy in {segment.path.name} at {entry.offset} does not hold what was downloaded")
            now = time.monotonic()
            if now - segment.touched > TOUCH_S:  # least recently used: the access time, set now and then
                segment.touched = now
                try:  # while this read holds the descriptor: closed, its number could be another file's
                    os.utime(fd, ns=(time.time_ns(), os.fstat(fd).st_mtime_ns))
                except OSError:
                    pass  # another user's segment, readable but not ours to mark: it only ages
        finally:
            self._release(segment)
        return data

    def _acquire(self, segment: Segment) -> int:
        """A read descriptor of ``segment``, held (``users``) until ``_release``: the one kept,
        or one opened now if the path still is the file first seen; ``CopyGone`` else."""
        with self._lock:
            if segment.gone:
                raise CopyGone(f"segment {segment.path.name} is no longer kept")
            if segment.fd < 0:
                fd = self._open_fd(segment.path)
                try:
                    info = os.fstat(fd)
                except OSError:
                    os.close(fd)
                    raise
                if info.st_ino != segment.inode or not stat.S_ISREG(info.st_mode):
                    os.close(fd)
                    raise CopyGone(f"segment {segment.path.name} was replaced")
                segment.fd = fd
                self._open_fds[segment] = None
            else:
                self._open_fds.move_to_end(segment)
            segment.users += 1  # before trimming: this one is not closed
            self._trim()
            return segment.fd

    def _release(self, segment: Segment) -> None:
        with self._lock:
            segment.users -= 1
            self._close_if_unused(segment)
            self._trim()

    def _open_fd(self, path: Path) -> int:
        """``os.open`` for reading (under ``_lock``); out of descriptors, the kept ones not in
        use are closed and it is tried once more (``CopyGone`` if it cannot be opened)."""
        for attempt in range(2):
            try:
                return os.open(path, READ_FLAGS)
            except OSError as error:
                if attempt == 0 and error.errno in (errno.EMFILE, errno.ENFILE):
                    for segment in [segment for segment in self._open_fds if not segment.users]:
                        self._close(segment)
                    continue
                raise CopyGone(f"cannot open {path.name}: {error}") from error
        raise AssertionError("unreachable")

    def _trim(self) -> None:
        """Closes the least recently used descriptors not in use, down to ``MAX_OPEN``."""
        if len(self._open_fds) <= MAX_OPEN:
            return
        for segment in list(self._open_fds):
            if len(self._open_fds) <= MAX_OPEN:
                break
            if not segment.users:
                self._close(segment)

    def _close(self, segment: Segment) -> None:
        self._open_fds.pop(segment, None)
        if segment.fd >= 0:
            os.close(segment.fd)
            segment.fd = -1

    def count(self) -> int:
        """How many objects are indexed in segments still known."""
        return len(self.entries)

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
            if name != own and not segment.sealed and not segment.gone:
                try:
                    fd = self._acquire(segment)
                except CopyGone:
                    continue  # evicted or replaced: the next scan forgets it
                try:
                    size = os.fstat(fd).st_size
                finally:
                    self._release(segment)
                self._follow(name, segment, size)

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
        if segment.sealed and (segment.torn or size <= segment.parsed):
            return  # nothing to open it for
        try:
            fd = self._acquire(segment)
        except CopyGone:
            return  # evicted or replaced since the scan: the next one forgets it
        try:
            if not segment.sealed:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # its writer took LOCK_EX before its magic
                except BlockingIOError:
                    pass
                else:
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    segment.sealed = True
                    size = os.fstat(fd).st_size  # all it will ever hold
            if not segment.torn and size > segment.parsed:
                self._parse(name, segment, fd, size)
        finally:
            self._release(segment)

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
            segment.urls.append(url)
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

    def close_descriptors(self) -> None:
        """Closes the read descriptors no read uses (the index stays: a pass is over, and a
        descriptor kept until the next would hold a segment a peer evicts meanwhile, its disk
        not freed; the next read opens it again, the inode checked)."""
        with self._lock:
            for segment in [segment for segment in self._open_fds if not segment.users]:
                self._close(segment)

    def close(self) -> None:
        self.seal()
        with self._lock:
            for segment in self.segments.values():
                segment.gone = True
                self._close_if_unused(segment)
            for segment in list(self._open_fds):  # dropped ones a read still held
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
        """The segment at ``path``, now known, if it still is what the scan saw and starts with
        ``FILE_MAGIC`` (else it is not ours, or not yet: looked at again later); its descriptor
        is kept among the ``MAX_OPEN``."""
        with self._lock:
            try:
                fd = self._open_fd(path)
            except CopyGone:
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
            segment = self.segments[name] = Segment(path, info.st_ino, fd)
            self._open_fds[segment] = None
            self._trim()
        return segment

    def _parse(self, name: str, segment: Segment, fd: int, size: int) -> None:
        """Indexes the complete records of ``segment`` (read through ``fd``, held) from where it
        stopped up to ``size``."""
        at = segment.parsed
        while at + RECORD.size <= size:
            try:
                head = os.pread(fd, HEADER_READ, at)
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
                head = os.pread(fd, texts - at, at)
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
            segment.urls.append(url)
            at = texts + length
        segment.parsed = at
        segment.size = size

    def _drop(self, name: str) -> None:
        """Forgets the segment (evicted, or replaced): its entries, and its descriptor once no
        read uses it (a URL since written again elsewhere keeps its newer entry)."""
        with self._lock:
            segment = self.segments.pop(name, None)
            if segment is not None:
                segment.gone = True
                self._close_if_unused(segment)
        if segment is not None:
            for url in segment.urls:
                entry = self.entries.get(url)
                if entry is not None and entry.segment == name:
                    del self.entries[url]
            segment.urls = []

    def _close_if_unused(self, segment: Segment) -> None:
        if segment.gone and not segment.users:
            self._close(segment)

    def _start_segment(self) -> None:
        name = f"{time.time_ns():016x}{uuid.uuid4().hex[:16]}"  # sorts by creation time
        path = self.directory / f"asyncload-items-{name}.seg"
        fd = os.open(path, NEW_FLAGS, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new name: nobody else holds it
            os.pwrite(fd, FILE_MAGIC, 0)
            inode = os.fstat(fd).st_ino
        except OSError:
            os.close(fd)
            _unlink(path)
            raise
        self.segments[name] = Segment(path, inode, size=len(FILE_MAGIC))  # read descriptor: on demand
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
