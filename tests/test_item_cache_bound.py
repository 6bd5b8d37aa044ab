"""cache_bytes bounds the item cache's folder once a run has ended, whatever the timing
(io/cache_items.py, io/cache.py ``aclose``). The item cache counts what it downloads and scans the
folder only when its count says it may pass cache_bytes; a count misses copies a peer (another
process or run on the node) installs meanwhile, and objects downloaded but not yet on disk while
one of its own scans ran (the scan's total replaces the count). So the end of a run always scans,
even with no download under way. Both cases on the real S3 server: the writes of the second held,
by a wrapper around the reader's thread pool, until a scan has run."""

from __future__ import annotations

import asyncio
import os

from typing import Any

from asyncload.io import cache_files
from asyncload.io.cache_evict import evict_to
from asyncload.io.cache_items import ItemCache
from asyncload.io.reader import Reader
from asyncload.stats.figures import LoaderStats
from tests.conftest import make_bucket, setup_s3fs

SIZE = 1000
CAP = 8 * SIZE


def put_objects(s3_options, prefix: str, count: int) -> dict[str, bytes]:
    """``count`` objects of ``SIZE`` random bytes under ``prefix``: url -> bytes."""
    objects = {f"{prefix}/{index}.bin": os.urandom(SIZE) for index in range(count)}
    with setup_s3fs(s3_options) as fs:
        make_bucket(fs)
        fs.pipe(objects)
    return {f"s3://{path}": data for path, data in objects.items()}


def owned(folder) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.name.startswith("asyncload-")
               and not p.name.endswith((".meta", ".lock")))


def test_a_peers_copies_are_evicted_at_the_end_of_a_run(s3_options, tmp_path):
    objects = put_objects(s3_options, "asyncload-test/item-cache-bound/peer", 9)
    urls = list(objects)
    folder = tmp_path / "cache"

    async def main() -> None:
        reader = Reader(asyncio.get_running_loop(), storage_options=s3_options, timeout=30.0, retries=2,
                        io_concurrency=8, stats=LoaderStats())
        try:
            late = ItemCache(str(folder), CAP, reader, None)  # counts the folder now: empty
            peer = ItemCache(str(folder), 1 << 20, reader, None)  # another run's budget
            for index, url in enumerate(urls[:8]):
                assert await peer.read(url, index) == objects[url]
            await peer.aclose()
            assert owned(folder) == CAP  # the peer's copies, unknown to late's count
            assert await late.read(urls[8], 8) == objects[urls[8]]
            await late.aclose()  # no download under way: the count alone would not scan
            assert owned(folder) <= CAP
        finally:
            await reader.aclose()

    asyncio.run(main())


class WritesHeldForAScan:
    """The real reader, whose thread work (``run_blocking``) holds the cache's writes of new
    copies, once ``arm``ed, until a scan of the folder (``evict_to``) has run after them."""

    def __init__(self, reader: Reader) -> None:
        self.reader = reader
        self.armed = False
        self.held = 0
        self.scanned = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.reader, name)

    async def run_blocking(self, function: Any, *args: Any) -> Any:
        if function is cache_files.write_new and self.armed:
            self.held += 1
            await self.scanned.wait()
        result = await self.reader.run_blocking(function, *args)
        if function is evict_to and self.armed and self.held:
            self.armed = False
            self.scanned.set()
        return result


def test_copies_written_while_a_scan_ran_are_evicted_at_the_end_of_a_run(s3_options, tmp_path):
    """Two objects downloaded (and counted) but not yet written when a scan runs: the scan's
    total, without them, replaces the count, which then says the folder fits when it does not."""
    objects = put_objects(s3_options, "asyncload-test/item-cache-bound/scan", 9)
    urls = list(objects)
    folder = tmp_path / "cache"

    async def main() -> None:
        real = Reader(asyncio.get_running_loop(), storage_options=s3_options, timeout=30.0, retries=2,
                      io_concurrency=8, stats=LoaderStats())
        reader = WritesHeldForAScan(real)
        try:
            cache = ItemCache(str(folder), CAP, reader, None)
            for index, url in enumerate(urls[:6]):
                await cache.read(url, index)
            reader.armed = True
            held = [asyncio.ensure_future(cache.read(url, 6 + index)) for index, url in enumerate(urls[6:8])]
            for _ in range(3000):  # until both are downloaded and counted, their writes held
                if reader.held == len(held) or any(task.done() for task in held):
                    break
                await asyncio.sleep(0.01)
            assert reader.held == len(held)
            assert await cache.read(urls[8], 8) == objects[urls[8]]  # it scans first: the held two are not on disk
            assert await asyncio.gather(*held) == [objects[url] for url in urls[6:8]]
            assert reader.scanned.is_set()
            assert owned(folder) > CAP  # what the count missed: no later download would scan
            await cache.aclose()
            assert owned(folder) <= CAP
        finally:
            await real.aclose()

    asyncio.run(main())
