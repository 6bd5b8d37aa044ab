"""What the shard cache costs on the cold epoch (cache/shards.py, cache/files.py): its downloads
reserve their file first (a full disk is found before a byte is fetched for it, and the writes
that follow cost the kernel far less CPU), write at most ``WRITE_PIECE`` bytes a call, and record
the checksum they took, so the next epoch does not read every copy whole again to check it."""

from __future__ import annotations

import os
import warnings

import pytest

from asyncload import AsyncLoader, ImageDecoder, tar_shards
from asyncload.cache import files as cache_files
from tests.conftest import delivered, flat
from tests.test_cache import ALL, shards, small_disk  # noqa: F401 (fixtures)


def test_a_full_disk_is_found_before_the_download(shards, s3_options, small_disk):  # noqa: F811
    """A shard that the disk cannot hold was downloaded (one GET) before the write failed, then
    read from storage again: two GETs for it. Now its file is reserved first: one read a shard."""
    url, _, _ = shards
    source = tar_shards(url, storage_options=s3_options, cache_dir=str(small_disk), cache_bytes=1 << 30)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with AsyncLoader(source, batch_size=8, decode=ImageDecoder(32), storage_options=s3_options) as loader:
            assert sorted(flat(delivered(loader))) == ALL
            assert loader.stats.as_dict()["read/items"] == len(source.urls)
    assert not [p for p in small_disk.iterdir() if p.name.endswith(".part")]


def test_writes_are_cut_in_pieces(tmp_path, monkeypatch):
    """One write() of 16 MB cost the kernel ~10x the CPU of sixteen of 1 MB (a cold epoch is
    decode-bound: that CPU was the decoders'); the data and its checksum are unchanged."""
    sizes = []
    real_write = os.write

    def spy(fd, data):
        sizes.append(len(data))
        return real_write(fd, data)

    data = os.urandom(3 * cache_files.WRITE_PIECE + 5)
    fd = cache_files.new_file(tmp_path / "part")
    try:
        monkeypatch.setattr(cache_files.os, "write", spy)
        crc = cache_files.write_all(fd, data, 0)
    finally:
        monkeypatch.undo()
        os.close(fd)
    assert sizes == [cache_files.WRITE_PIECE] * 3 + [5]
    assert (tmp_path / "part").read_bytes() == data and crc == __import__("zlib").crc32(data)


def test_the_next_epoch_does_not_read_copies_whole_again(shards, s3_options, tmp_path, monkeypatch):  # noqa: F811
    """The download took each copy's checksum as it wrote it; the next run in the process (a new
    ShardCache) read every copy whole once more to check it."""
    url, _, _ = shards
    source = tar_shards(url, storage_options=s3_options, cache_dir=str(tmp_path))
    for number in range(2):
        if number == 1:
            checked = []
            real = cache_files.checksum
            monkeypatch.setattr(cache_files, "checksum", lambda fd, size: checked.append(size) or real(fd, size))
        with AsyncLoader(source, batch_size=8, decode=ImageDecoder(32), storage_options=s3_options) as loader:
            assert sorted(flat(delivered(loader))) == ALL
    assert checked == []


@pytest.mark.parametrize("processes", [0, 2])
def test_a_cold_epoch_with_a_cache_reads_what_one_without_does(shards, s3_options, tmp_path, processes):  # noqa: F811
    """The bytes and requests of a cold epoch are those of the same epoch without a cache."""
    url, _, _ = shards
    counts = []
    for cache in (None, str(tmp_path / "cache")):
        source = tar_shards(url, storage_options=s3_options, cache_dir=cache)
        with AsyncLoader(source, batch_size=8, decode=ImageDecoder(32), storage_options=s3_options,
                         processes=processes) as loader:
            assert sorted(flat(delivered(loader))) == ALL
            stats = loader.stats.as_dict()
            counts.append((stats["read/items"], stats["read/bytes"]))
    assert counts[1][0] == counts[0][0]
    assert counts[1][1] >= counts[0][1]  # whole shards: their headers and padding too


def test_a_chunk_is_served_before_its_shard_is_downloaded_whole(tmp_path):
    """A read of a shard's first bytes waited for its last chunk: a cold epoch decoded nothing of
    a shard until all of it had come. Now it is served once its own bytes are written; the
    download goes on, and the copy is installed whole, with its meta."""
    import asyncio
    import zlib

    from asyncload.cache.shards import ShardCache
    from asyncload.cache.files import read_meta, shard_files

    url, blob, chunk = "s3://b/shard.tar", bytes(range(256)) * 16, 1024

    async def main():
        last_chunk = asyncio.Event()

        async def download(url, start, end):
            if end == len(blob):
                await last_chunk.wait()
            return blob[start:end]

        async def run_blocking(function, *args):
            return await asyncio.to_thread(function, *args)

        async def version(url):
            return "v1"

        cache = ShardCache(tmp_path, 1 << 20, download, chunk, run_blocking, version=version, timeout=5)
        first = await asyncio.wait_for(cache.read_range(url, 10, 20, len(blob)), 5)
        assert first == blob[10:20] and not cache.path(url).exists()
        last_chunk.set()
        assert await asyncio.wait_for(cache.read_range(url, len(blob) - 10, len(blob), len(blob)), 5) == blob[-10:]
        assert await cache.ensure(url, len(blob))  # the copy, installed whole
        await cache.aclose()
        return cache

    cache = asyncio.run(main())
    assert cache.path(url).read_bytes() == blob
    assert read_meta(shard_files(tmp_path, url).meta)["crc32"] == zlib.crc32(blob)


def test_a_chunk_is_served_before_its_bytes_reach_the_disk(tmp_path):
    """A busy disk took seconds to write a 16 MB chunk, and the reads within it waited for the
    write; now they are served from the downloaded bytes while they are written."""
    import asyncio
    import threading

    from asyncload.cache import files as cache_files
    from asyncload.cache.shards import ShardCache

    url, blob, chunk = "s3://b/shard.tar", bytes(range(256)) * 16, 1024
    writing = threading.Event()

    async def main():
        async def download(url, start, end):
            return blob[start:end]

        async def run_blocking(function, *args):
            if function is cache_files.write_all:
                return await asyncio.to_thread(lambda: writing.wait(10) and function(*args))
            return await asyncio.to_thread(function, *args)

        async def version(url):
            return "v1"

        cache = ShardCache(tmp_path, 1 << 20, download, chunk, run_blocking, version=version, timeout=5)
        try:
            assert await asyncio.wait_for(cache.read_range(url, 10, 20, len(blob)), 5) == blob[10:20]
        finally:
            writing.set()
        assert await cache.read_range(url, len(blob) - 10, len(blob), len(blob)) == blob[-10:]
        assert await cache.ensure(url, len(blob))
        await cache.aclose()

    asyncio.run(main())
    assert (tmp_path / next(p for p in os.listdir(tmp_path) if p.endswith("-shard.tar"))).read_bytes() == blob


def spy_on(monkeypatch, owner, name: str, calls: list) -> None:
    """Records each call of ``owner.name`` (a function or a coroutine function) in ``calls``."""
    import inspect

    real = getattr(owner, name)
    if inspect.iscoroutinefunction(real):
        async def spy(*args):
            calls.append(args)
            return await real(*args)
    else:
        def spy(*args):
            calls.append(args)
            return real(*args)
    monkeypatch.setattr(owner, name, spy)


def test_a_second_pass_reads_its_samples_from_the_copies_on_the_decode_threads(shards, s3_options, tmp_path,  # noqa: F811
                                                                               monkeypatch):
    """Each pass built a new shard cache, which asked storage about every shard again, and read
    every sample through a chunk read and a task on the event loop: more CPU a sample than
    reading the bucket. Now the next pass asks nothing and reads no chunk: the decode threads
    read each sample from the copy this process checked."""
    from asyncload.io.reader import Reader

    url, _, _ = shards
    asked, chunk_reads = [], []
    spy_on(monkeypatch, Reader, "version", asked)
    spy_on(monkeypatch, cache_files, "read_copy_range", chunk_reads)
    source = tar_shards(url, storage_options=s3_options, cache_dir=str(tmp_path))
    counts = []
    with AsyncLoader(source, batch_size=8, decode=ImageDecoder(32), storage_options=s3_options) as loader:
        for _ in range(2):
            asked.clear()
            chunk_reads.clear()
            assert sorted(flat(delivered(loader))) == ALL
            counts.append((len(asked), len(chunk_reads), loader.stats.as_dict()["read/items"]))
    assert counts[0][0] == len(source.urls)
    assert counts[1] == (0, 0, counts[0][2])  # nothing asked, no chunk read, nothing downloaded again


def replace_a_copy(cache_dir, url: str):
    """Puts another file (another inode, the same bytes) in place of ``url``'s cached copy, as a
    peer's new download would; returns the copy's path."""
    copy = cache_files.shard_files(cache_dir, url).shard
    replacement = cache_dir / "elsewhere"
    replacement.write_bytes(copy.read_bytes())
    os.replace(replacement, copy)
    return copy


def test_a_copy_replaced_since_its_check_is_not_read_by_the_decode_threads(shards, s3_options, tmp_path,  # noqa: F811
                                                                           monkeypatch):
    """The decode threads read only the copy this process checked (its checksum held): a file
    put in its place since (a peer's new download: another inode) goes through the cache's own
    reads on the loop, and every sample is still delivered once."""
    url, _, _ = shards
    source = tar_shards(url, storage_options=s3_options, cache_dir=str(tmp_path))
    with AsyncLoader(source, batch_size=8, decode=ImageDecoder(32), storage_options=s3_options) as loader:
        assert sorted(flat(delivered(loader))) == ALL
        copy = replace_a_copy(tmp_path, source.urls[1])
        reads: list = []
        spy_on(monkeypatch, cache_files, "read_copy_range", reads)
        assert sorted(flat(delivered(loader))) == ALL
    assert reads and {args[0] for args in reads} == {copy}


def test_a_copy_replaced_since_its_check_is_checked_again_and_read_by_the_decode_threads(  # noqa: F811
        shards, s3_options, tmp_path, monkeypatch):
    """A copy replaced since this loader checked it (a peer, or this loader's children, evicted
    and downloaded it again) fell back to a ranged read on the loop for every sample of every
    later pass: the loader's 'current' said the shard was known, so ``ensure`` never checked the
    new copy whole and the decode threads never read it. Now the first fallback forgets it, the
    cache checks the new copy once, and the pass after reads it on the decode threads."""
    url, _, _ = shards
    source = tar_shards(url, storage_options=s3_options, cache_dir=str(tmp_path))
    with AsyncLoader(source, batch_size=8, decode=ImageDecoder(32), storage_options=s3_options) as loader:
        assert sorted(flat(delivered(loader))) == ALL
        copy = replace_a_copy(tmp_path, source.urls[1])
        assert sorted(flat(delivered(loader))) == ALL
        reads: list = []
        spy_on(monkeypatch, cache_files, "read_copy_range", reads)
        assert sorted(flat(delivered(loader))) == ALL
    assert reads == []
