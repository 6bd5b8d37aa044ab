"""The item cache's index (cache/item_files.py) on real segment files: a bounded number of
descriptors however many segments the folder holds (every copy still served byte for byte, a
segment replaced between two opens not read as the old one), the access time set on the segment
read and no other file, the entries of an evicted segment gone from the index, and an unlisted
object's copy read by the decode thread."""

from __future__ import annotations

import asyncio
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from asyncload.cache import item_files
from asyncload.cache.items import CopyRead, ItemCache
from asyncload.cache.item_files import FILE_MAGIC, MAX_OPEN, CopyGone, SegmentStore
from tests.test_item_cache_bound import new_reader, put_objects

SEGMENTS = 300  # one object a segment: a folder of 300 segments, as a 19 GiB cache of 64 MiB ones


def fill(folder: pathlib.Path, count: int = SEGMENTS, size: int = 9000) -> dict[str, bytes]:
    """``count`` segments of one object each, written by a store now closed: url -> bytes."""
    objects = {f"s3://b/{index}": os.urandom(size) for index in range(count)}
    writer = SegmentStore(folder, 8192)  # each object fills its segment: the next starts a new one
    for url, data in objects.items():
        writer.append([(url, "v", data)])
    writer.close()
    return objects


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def fds_on(folder) -> list[str]:
    """What this process's open descriptors point at inside ``folder``."""
    paths = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if path.startswith(f"{folder}/"):
            paths.append(path)
    return paths


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
def test_descriptors_stay_bounded_while_every_copy_is_served(tmp_path):
    """A descriptor per segment was kept open for the process's life (a thousand at the default
    budget): now at most MAX_OPEN, and every copy still reads back exactly."""
    objects = fill(tmp_path)
    before = open_fds()
    store = SegmentStore(tmp_path, 8192)
    store.refresh()
    assert store.count() == SEGMENTS
    assert open_fds() - before <= MAX_OPEN
    for _ in range(2):  # the second pass opens again what the first let go of
        assert {url: store.read(entry) for url, entry in store.entries.items()} == objects
        assert open_fds() - before <= MAX_OPEN
    store.close()
    assert open_fds() == before


def test_a_low_descriptor_limit_indexes_counts_and_evicts_every_segment(tmp_path):
    """Under RLIMIT_NOFILE 128 (a thousand segments under the usual 1,024), every segment is
    indexed and counted, eviction brings the folder to its budget, and the process can still
    open sockets: opening a segment failed with EMFILE, which left it unindexed, uncounted and
    never evicted."""
    fill(tmp_path)
    code = textwrap.dedent(f"""
        import pathlib, resource, socket
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
        from asyncload.cache.item_files import SegmentStore
        folder = pathlib.Path({str(tmp_path)!r})
        store = SegmentStore(folder, 8192)
        store.refresh()
        assert store.count() == {SEGMENTS}, store.count()
        whole = sum(p.stat().st_size for p in folder.iterdir())
        assert store.total == whole, (store.total, whole)
        left = store.evict(100_000)
        assert left == sum(p.stat().st_size for p in folder.iterdir()) <= 100_000, left
        sockets = [socket.socket() for _ in range(16)]
        for s in sockets:
            s.close()
        store.close()
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).parent.parent)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_a_segment_replaced_between_two_opens_is_not_read_as_the_old_one(tmp_path, monkeypatch):
    """A descriptor let go of is opened again by path: if another file took the name since (the
    segment evicted and a new one made), the read is CopyGone (downloaded again), not the other
    file's bytes at the old offset."""
    monkeypatch.setattr(item_files, "MAX_OPEN", 1)
    objects = fill(tmp_path, 2)
    store = SegmentStore(tmp_path, 8192)
    store.refresh()
    first, second = (store.entries[url] for url in objects)
    assert store.read(second) == objects["s3://b/1"]  # the first segment's descriptor is let go of
    path = store.segments[first.segment].path
    replacement = tmp_path / "replacement"
    replacement.write_bytes(FILE_MAGIC + os.urandom(path.stat().st_size))
    os.replace(replacement, path)
    with pytest.raises(CopyGone):
        store.read(first)
    assert store.read(second) == objects["s3://b/1"]
    store.close()


def test_the_access_time_is_set_on_the_segment_read_and_no_other_file(tmp_path, monkeypatch):
    """A read marks its segment used (eviction is least recently used first). It did so through
    the segment's descriptor after letting go of it: an eviction on the disk thread could close
    it and the number be another file's by then. Here the eviction and the other file's open
    come exactly there (the read's ``fstat``); the other file keeps its times."""
    objects = fill(tmp_path, 1)
    store = SegmentStore(tmp_path, 8192)
    store.refresh()
    entry = store.entries["s3://b/0"]
    segment = store.segments[entry.segment]
    other = tmp_path / "someone-elses-file"
    other.write_bytes(b"not ours")
    os.utime(other, ns=(10**18, 10**18))
    os.utime(segment.path, ns=(10**18, 10**18))
    real_fstat = os.fstat
    interrupted = []

    def fstat(fd):
        if not interrupted and isinstance(fd, int) and fd >= 0:
            interrupted.append(fd)
            store._drop(entry.segment)  # the disk thread's eviction, at the worst moment
            interrupted.append(os.open(other, os.O_RDONLY))  # takes the lowest free number
        return real_fstat(fd)

    monkeypatch.setattr(item_files.os, "fstat", fstat)
    try:
        assert store.read(entry) == objects["s3://b/0"]
    finally:
        monkeypatch.undo()
        if len(interrupted) == 2:
            os.close(interrupted[1])
    assert len(interrupted) == 2
    assert other.stat().st_atime_ns == 10**18
    store.close()


def test_an_evicted_segments_entries_leave_the_index(tmp_path):
    """Eviction forgot the segments but kept their entries (100,000 left after evicting all):
    now they go with their segment; a URL written again in a newer segment keeps that entry."""
    objects = fill(tmp_path, 4)
    newer = os.urandom(9000)
    later = SegmentStore(tmp_path, 8192)
    later.append([("s3://b/0", "v2", newer)])  # s3://b/0 again, in a fifth segment
    later.close()
    store = SegmentStore(tmp_path, 8192)
    store.refresh()
    assert store.count() == 4
    oldest = sorted(store.segments)[:2]  # written first: s3://b/0 and s3://b/1's segments
    for name in oldest:
        os.utime(store.segments[name].path, ns=(10**9, 10**9))  # least recently used
    left = store.evict(sum(p.stat().st_size for p in tmp_path.iterdir()) - 1)
    assert left > 0
    assert len(store.segments) == 4
    assert store.count() == 4  # s3://b/0's first segment went; its newer entry stays
    assert store.read(store.entries["s3://b/0"]) == newer
    store.evict(left - 1)
    assert store.lookup("s3://b/1") is None and "s3://b/1" not in store.entries
    assert {url: store.read(entry) for url, entry in store.entries.items()} == \
        {url: data for url, data in objects.items() if url in store.entries} | {"s3://b/0": newer}
    store.evict(0)
    assert store.count() == 0 and store.entries == {}
    store.close()


def test_an_unlisted_objects_copy_is_read_by_the_decode_thread(s3_options, tmp_path):
    """A manifest's item is not listed: a new pass asks storage about it, then found its copy
    and read and checked it on the event loop. ``fetch`` hands the pipeline a ``CopyRead``
    instead, which the decode thread reads, byte for byte; ``read`` still gives the bytes."""
    objects = put_objects(s3_options, "asyncload-test/item-cache-index/unlisted", 3)
    urls = list(objects)
    folder = tmp_path / "cache"

    async def main() -> None:
        reader = new_reader(s3_options)
        try:
            first = ItemCache(str(folder), 1 << 20, reader, None)
            for index, url in enumerate(urls):
                assert await first.read(url, index) == objects[url]
            await first.aclose()
            before = reader.stats.as_dict()["read/items"]
            second = ItemCache(str(folder), 1 << 20, reader, None)  # the next pass
            copies = [await second.fetch(url, index) for index, url in enumerate(urls)]
            assert [type(copy) for copy in copies] == [CopyRead] * len(urls)
            loop = asyncio.get_running_loop()
            assert [await loop.run_in_executor(None, copy.read) for copy in copies] == list(objects.values())
            assert await second.read(urls[0], 0) == objects[urls[0]]
            assert reader.stats.as_dict()["read/items"] == before  # nothing downloaded
            await second.aclose()
        finally:
            await reader.aclose()

    asyncio.run(main())


def test_the_loaders_close_does_not_close_the_segment_a_pass_still_writes(s3_options, tmp_path, monkeypatch):
    """``KeptCaches.close`` (the loader's close) closed the kept store at once, even while a pass
    whose stop timed out still wrote to it on its disk thread: the writer's descriptor was closed
    under the write, and the next file the process opened took its number, so the batch went into
    that file (a checkpoint, say) and the cache lost it. Now the pass that holds the index closes
    it at its own end."""
    import threading

    from asyncload.cache.items import KeptIndex

    objects = put_objects(s3_options, "asyncload-test/item-cache-index/close-under-write", 1)
    url, data = next(iter(objects.items()))
    folder = tmp_path / "cache"
    entered, release = threading.Event(), threading.Event()
    real = item_files._write_pieces

    def held_write(fd, pieces, at):
        entered.set()
        release.wait(30)
        return real(fd, pieces, at)

    monkeypatch.setattr(item_files, "_write_pieces", held_write)

    async def main() -> None:
        reader = new_reader(s3_options)
        try:
            kept = KeptIndex(str(folder), 1 << 20)
            cache = ItemCache(str(folder), 1 << 20, reader, None, kept)
            reading = asyncio.ensure_future(cache.read(url, 0))
            assert await asyncio.get_running_loop().run_in_executor(None, entered.wait, 30)
            kept.close()  # the loader's close, while the pass's write is under way
            with open(tmp_path / "other", "wb"):  # the lowest free descriptor number
                release.set()
                assert await reading == data
            await cache.aclose()
        finally:
            await reader.aclose()

    asyncio.run(main())
    assert (tmp_path / "other").read_bytes() == b""
    store = SegmentStore(folder, 1 << 20)
    store.refresh()
    assert {u: store.read(entry) for u, entry in store.entries.items()} == objects
    store.close()
    # the cache's own descriptors, not the process's count: another test's thread left in this
    # worker may open or close a file meanwhile (27 against 26 once, in a fresh clone's CI)
    assert fds_on(folder) == [], "a descriptor on the cache's files outlived its store"
