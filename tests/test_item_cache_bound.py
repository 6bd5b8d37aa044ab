"""cache_bytes bounds the item cache's folder once a run has ended, whatever the timing
(io/cache_items.py, io/cache.py ``aclose``). The item cache counts what it downloads and scans the
folder only when its count says it may pass cache_bytes; a count misses copies a peer (another
process or run on the node) installs meanwhile, and copies written while one of its own scans ran.
So the end of a run always scans, even with no download under way: two runs sharing one folder
on the real S3 server, the second's count blind to the first's copies, leave it within bounds."""

from __future__ import annotations

import asyncio
import os

from asyncload.io.cache_items import ItemCache
from asyncload.io.reader import Reader
from asyncload.stats.figures import LoaderStats
from tests.conftest import make_bucket, setup_s3fs

SIZE = 1000
CAP = 8 * SIZE


def owned(folder) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.name.startswith("asyncload-")
               and not p.name.endswith((".meta", ".lock")))


def test_a_run_ends_with_the_folder_within_cache_bytes(s3_options, tmp_path):
    prefix = "asyncload-test/item-cache-bound"
    objects = {f"{prefix}/{index}.bin": os.urandom(SIZE) for index in range(9)}
    with setup_s3fs(s3_options) as fs:
        make_bucket(fs)
        fs.pipe(objects)
    urls = [f"s3://{path}" for path in objects]
    folder = tmp_path / "cache"

    async def main() -> None:
        reader = Reader(asyncio.get_running_loop(), storage_options=s3_options, timeout=30.0, retries=2,
                        io_concurrency=8, stats=LoaderStats())
        try:
            late = ItemCache(str(folder), CAP, reader, None)  # counts the folder now: empty
            peer = ItemCache(str(folder), 1 << 20, reader, None)  # another run's budget
            for index, url in enumerate(urls[:8]):
                assert await peer.read(url, index) == objects[url[len("s3://"):]]
            await peer.aclose()
            assert owned(folder) == CAP  # the peer's copies, unknown to late's count
            assert await late.read(urls[8], 8) == objects[urls[8][len("s3://"):]]
            await late.aclose()  # no download under way: the count alone would not scan
            assert owned(folder) <= CAP
        finally:
            await reader.aclose()

    asyncio.run(main())
