"""cache_bytes bounds the item cache's folder (cache/items.py, cache/item_files.py), at a cost
linear in what it evicts: whole segments go, one scan at a time, every scan's iterator closed. And
the folder is shared: a new run (or another process) finds what a run wrote, byte for byte; a
writer killed mid-batch leaves a tail nobody reads. All on the real S3 server, with the real
reader; ``os.scandir`` is wrapped only to count the scans and see that each is closed."""

from __future__ import annotations

import asyncio
import os

import pytest

from asyncload.cache import item_files as cache_segments
from asyncload.cache.items import ItemCache
from asyncload.cache.item_files import SegmentStore
from asyncload.io.reader import Reader
from asyncload.stats.loader_stats import LoaderStats
from tests.conftest import make_bucket, setup_s3fs

SIZE = 1000
CAP = 8 * SIZE


def put_objects(s3_options, prefix: str, count: int, size: int = SIZE) -> dict[str, bytes]:
    """``count`` objects of ``size`` random bytes under ``prefix``: url -> bytes."""
    objects = {f"{prefix}/{index}.bin": os.urandom(size) for index in range(count)}
    with setup_s3fs(s3_options) as fs:
        make_bucket(fs)
        fs.pipe(objects)
    return {f"s3://{path}": data for path, data in objects.items()}


def owned(folder) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.name.startswith("asyncload-items-"))


def new_reader(s3_options) -> Reader:
    return Reader(asyncio.get_running_loop(), storage_options=s3_options, timeout=30.0, retries=2,
                  io_concurrency=8, stats=LoaderStats())


def test_a_peers_segments_are_evicted_at_the_end_of_a_run(s3_options, tmp_path):
    """A count of this process's own writes misses a peer's (another process or run on the node):
    the end of a run scans and evicts whatever passes cache_bytes."""
    objects = put_objects(s3_options, "asyncload-test/item-cache-bound/peer", 9)
    urls = list(objects)
    folder = tmp_path / "cache"

    async def main() -> None:
        reader = new_reader(s3_options)
        try:
            late = ItemCache(str(folder), CAP, reader, None)  # counts the folder now: empty
            peer = ItemCache(str(folder), 1 << 20, reader, None)  # another run's budget
            for index, url in enumerate(urls[:8]):
                assert await peer.read(url, index) == objects[url]
            await peer.aclose()
            assert owned(folder) > CAP  # the peer's segment, unknown to late's count
            assert await late.read(urls[8], 8) == objects[urls[8]]
            await late.aclose()
            assert owned(folder) <= CAP
        finally:
            await reader.aclose()

    asyncio.run(main())


class CountedScans:
    """``os.scandir`` as it is, counting the scans, the segments they saw and the iterators not
    closed at the end."""

    def __init__(self) -> None:
        self.real = os.scandir
        self.scans = 0
        self.segments: set[str] = set()
        self.open: set[int] = set()

    def __call__(self, path):
        iterator = self.real(path)
        self.scans += 1
        number = self.scans
        self.open.add(number)
        scans = self

        class Closed:
            def __enter__(self):
                iterator.__enter__()
                return self

            def __exit__(self, *exc):
                scans.open.discard(number)
                return iterator.__exit__(*exc)

            def __iter__(self):
                for entry in iterator:
                    if cache_segments.NAME.match(entry.name):
                        scans.segments.add(entry.name)
                    yield entry

            def close(self):
                scans.open.discard(number)
                iterator.close()

        return Closed()


SCANNED = 400  # objects of 1 KiB through a cache of half their size: 25 copies to a segment


@pytest.fixture(scope="module")
def scanned_objects(s3_options) -> dict[str, bytes]:
    """Uploaded once for both parametrisations: the test reads them, never changes them."""
    return put_objects(s3_options, "asyncload-test/item-cache-bound/scans", SCANNED, 1024)


@pytest.mark.parametrize("concurrent", [1, 32])
def test_eviction_scans_the_folder_a_few_times_per_segment_not_per_copy(s3_options, scanned_objects, tmp_path,
                                                                        monkeypatch, concurrent):
    """400 objects of 1 KiB through a cache of half their size (segments of an eighth of it, 25
    copies each): the folder is scanned a few times per segment the run writes (an eviction is one
    scan for a segment's worth of copies; a miss after the folder changed is one more), not once
    per evicted copy (it was one scan per evicted copy, plus one per download under way:
    quadratic), and every scan's iterator is closed (1,088 were left open)."""
    objects = scanned_objects
    count = len(objects)
    urls = list(objects)
    folder = tmp_path / "cache"
    counted = CountedScans()
    monkeypatch.setattr(cache_segments.os, "scandir", counted)

    async def main() -> None:
        reader = new_reader(s3_options)
        try:
            cache = ItemCache(str(folder), count * 1024 // 2, reader, None)
            for start in range(0, count, concurrent):
                part = list(enumerate(urls))[start:start + concurrent]
                got = await asyncio.gather(*(cache.read(url, index) for index, url in part))
                assert got == [objects[url] for _, url in part]
            await cache.aclose()
        finally:
            await reader.aclose()

    asyncio.run(main())
    left = SegmentStore(folder, 1 << 30)
    left.refresh()
    left.close()
    evicted = count - len(left.entries)
    segments = len(counted.segments)
    assert owned(folder) <= count * 1024 // 2
    assert evicted >= count // 3
    assert evicted >= 8 * segments  # so that a scan per evicted copy is more than the next line allows
    assert counted.scans <= 6 * segments, f"{counted.scans} scans for {segments} segments ({evicted} copies evicted)"
    assert counted.open == set(), f"{len(counted.open)} scans left open"


def test_a_new_run_and_a_peer_read_exactly_what_was_written(s3_options, tmp_path):
    """Two caches on one folder (two processes of a node contend as these do: a segment's flock
    belongs to its open file): each serves the other's copies without a request once it looks,
    and a third opened afterwards (a new run) serves them all, byte for byte."""
    objects = put_objects(s3_options, "asyncload-test/item-cache-bound/share", 20)
    urls = list(objects)
    folder = tmp_path / "cache"

    async def main() -> None:
        reader = new_reader(s3_options)
        try:
            first = ItemCache(str(folder), 1 << 20, reader, None)
            second = ItemCache(str(folder), 1 << 20, reader, None)
            for index, url in enumerate(urls):
                assert await (first if index % 2 else second).read(url, index) == objects[url]
            before = reader.stats.as_dict()["read/items"]
            for index, url in enumerate(urls):
                assert await (second if index % 2 else first).read(url, index) == objects[url]
            assert reader.stats.as_dict()["read/items"] == before  # found in the peer's segment
            await first.aclose()
            await second.aclose()
            third = ItemCache(str(folder), 1 << 20, reader, None)
            for index, url in enumerate(urls):
                assert await third.read(url, index) == objects[url]
            assert reader.stats.as_dict()["read/items"] == before
            await third.aclose()
        finally:
            await reader.aclose()

    asyncio.run(main())


def test_a_writer_killed_mid_batch_leaves_a_tail_nobody_reads(tmp_path):
    """A segment cut in the middle of a record (its writer killed) serves the records before
    the cut and nothing after it."""
    store = SegmentStore(tmp_path, 1 << 20)
    store.append([("s3://b/a", "v", b"a" * 100), ("s3://b/b", "v", b"b" * 100)])
    (segment,) = [p for p in tmp_path.iterdir()]
    whole = segment.stat().st_size
    store.close()
    os.truncate(segment, whole - 10)
    later = SegmentStore(tmp_path, 1 << 20)
    later.refresh()
    assert {url: later.read(entry) for url, entry in later.entries.items()} == {"s3://b/a": b"a" * 100}
    later.close()


def test_a_hit_whose_segment_is_evicted_before_its_read_is_downloaded_again(s3_options, tmp_path):
    """The pipeline hands a hit to a decode thread, which reads it later: if its segment was
    evicted meanwhile (by this process or a peer), the decode thread has the object read again
    through the cache on the loop (downloaded), and gets its exact bytes."""
    objects = put_objects(s3_options, "asyncload-test/item-cache-bound/gone", 2)
    urls = list(objects)
    folder = tmp_path / "cache"

    async def main() -> None:
        reader = new_reader(s3_options)
        try:
            cache = ItemCache(str(folder), 1 << 20, reader, None)
            for index, url in enumerate(urls):
                assert await cache.read(url, index) == objects[url]
            hit = cache.hit(urls[0], 0)
            assert hit is not None
            before = reader.stats.as_dict()["read/items"]
            await reader.run_blocking(cache.store.seal)
            await reader.run_blocking(cache.store.evict, 0)  # what a peer's eviction would do
            assert owned(folder) == 0
            loop = asyncio.get_running_loop()
            assert await loop.run_in_executor(None, hit.read) == objects[urls[0]]  # as a decode thread
            assert reader.stats.as_dict()["read/items"] == before + 1
            await cache.aclose()
        finally:
            await reader.aclose()

    asyncio.run(main())
