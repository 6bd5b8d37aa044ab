"""The item cache's cold epoch (cache/items.py): what each miss costs on the event loop. The
misses a fill starts together share one look at the folder, and still find what a peer wrote.
On the real S3 server with the real reader; ``os.stat`` is wrapped only to count the looks."""

from __future__ import annotations

import asyncio
import os

from asyncload.cache.items import ItemCache
from tests.test_item_cache_bound import SIZE, new_reader, put_objects

VERSION = "listed v1"


def listed(index: int) -> tuple[int, str]:
    """Every object as a listing gives it (``image_folder``): its size and version, no request."""
    return SIZE, VERSION


class CountedLooks:
    """``os.stat`` as it is, counting the calls on one folder."""

    def __init__(self, folder) -> None:
        self.real = os.stat
        self.folder = os.fspath(folder)
        self.looks = 0

    def __call__(self, path, *args, **kwargs):
        if os.fspath(path) == self.folder:
            self.looks += 1
        return self.real(path, *args, **kwargs)


def test_misses_started_together_look_at_the_folder_once(s3_options, tmp_path, monkeypatch):
    """A fill's misses start in one turn of the loop: they share one look at the folder (a
    ``stat`` each was a fifth of the cold epoch's extra work on the loop), and every read still
    gets its exact bytes, each downloaded once."""
    objects = put_objects(s3_options, "asyncload-test/item-cache-cold/together", 16)
    urls = list(objects)
    folder = tmp_path / "cache"
    counted = CountedLooks(folder)

    async def main() -> None:
        reader = new_reader(s3_options)
        try:
            cache = ItemCache(str(folder), 1 << 20, reader, listed)
            monkeypatch.setattr(os, "stat", counted)
            got = await asyncio.gather(*(cache.read(url, index) for index, url in enumerate(urls)))
            looks = counted.looks
            monkeypatch.undo()
            assert got == [objects[url] for url in urls]
            assert reader.stats.as_dict()["read/items"] == len(urls)
            assert looks <= 2, f"{looks} looks at the folder for {len(urls)} misses started together"  # quiet's, refresh's
            await cache.aclose()
        finally:
            await reader.aclose()

    asyncio.run(main())


def test_a_miss_after_a_peers_write_finds_the_peers_copy(s3_options, tmp_path):
    """The shared look is per turn of the loop: a miss that comes after a peer wrote (here, in
    the next turns) looks again and reads the peer's copy, not the bucket."""
    objects = put_objects(s3_options, "asyncload-test/item-cache-cold/peer", 8)
    urls = list(objects)
    folder = tmp_path / "cache"

    async def main() -> None:
        reader = new_reader(s3_options)
        try:
            mine = ItemCache(str(folder), 1 << 20, reader, listed)
            peer = ItemCache(str(folder), 1 << 20, reader, listed)
            assert await asyncio.gather(*(mine.read(url, index) for index, url in enumerate(urls[:4]))) == \
                [objects[url] for url in urls[:4]]
            assert await asyncio.gather(*(peer.read(url, index) for index, url in enumerate(urls[4:], 4))) == \
                [objects[url] for url in urls[4:]]
            before = reader.stats.as_dict()["read/items"]
            assert await asyncio.gather(*(mine.read(url, index) for index, url in enumerate(urls))) == \
                [objects[url] for url in urls]
            assert reader.stats.as_dict()["read/items"] == before  # the peer's four from its segment
            await mine.aclose()
            await peer.aclose()
        finally:
            await reader.aclose()

    asyncio.run(main())


def test_a_quiet_look_is_not_kept_past_its_turn(s3_options, tmp_path):
    """A look that found the folder quiet holds for its own turn of the loop only: a peer that
    writes after it (here, between two reads of this process) is found by the next miss, which
    looks again, not skipped on the old look. The folder is made to look quiet without waiting
    out ``WINDOW_NS``: its modification time set a second back (``os.utime``), as after a pause."""
    objects = put_objects(s3_options, "asyncload-test/item-cache-cold/quiet", 2)
    urls = list(objects)
    folder = tmp_path / "cache"
    folder.mkdir()
    old = os.stat(folder).st_mtime_ns - 1_000_000_000
    os.utime(folder, ns=(old, old))

    async def main() -> None:
        reader = new_reader(s3_options)
        try:
            mine = ItemCache(str(folder), 1 << 20, reader, listed)
            peer = ItemCache(str(folder), 1 << 20, reader, listed)
            mine.store.refresh()  # mine has looked at the folder: a second old, nothing in it
            assert mine.store.quiet()
            assert await mine.read(urls[0], 0) == objects[urls[0]]  # its miss's look finds it quiet
            assert await peer.read(urls[1], 1) == objects[urls[1]]  # the peer's segment: the folder changes
            before = reader.stats.as_dict()["read/items"]
            assert await mine.read(urls[1], 1) == objects[urls[1]]
            assert reader.stats.as_dict()["read/items"] == before, "the peer's copy was not looked for"
            await mine.aclose()
            await peer.aclose()
        finally:
            await reader.aclose()

    asyncio.run(main())
