"""The shard cache's processes racing each other and their own cancels (cache/shards.py,
cache/evict.py): a slow download keeps its waiters, a stalled peer costs only the reads it
stalls, an eviction never deletes what a peer installs meanwhile, and a cancel never closes a
descriptor a pool thread still writes. Two ``ShardCache`` objects of one process contend as two
processes do (a ``flock`` belongs to its open file, not to the process)."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import threading
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor

import pytest

from asyncload.cache import evict as cache_evict, files as cache_files
from asyncload.cache.shards import ShardCache
from asyncload.cache.evict import evict
from asyncload.cache.files import install, shard_files, try_lock

URL = "s3://bucket/shard-000.tar"
CHUNK = 1000
BLOB = bytes(range(256)) * 16  # 4 chunks


class Storage:
    """A shard's bytes, counting the ranged reads each cache makes of it."""

    def __init__(self, slow_chunk_s: float = 0.0) -> None:
        self.reads = 0
        self.slow_chunk_s = slow_chunk_s

    async def download(self, url: str, start: int, end: int) -> bytes:
        self.reads += 1
        if start == CHUNK and self.slow_chunk_s:  # its first GET timed out and was retried
            await asyncio.sleep(self.slow_chunk_s)
        return BLOB[start:end]


async def version(url: str) -> str:
    return "v1"


async def in_thread(function, *args):
    return await asyncio.get_running_loop().run_in_executor(None, function, *args)


def new_cache(folder, storage: Storage, timeout: float, run_blocking=in_thread) -> ShardCache:
    return ShardCache(folder, 1 << 20, storage.download, CHUNK, run_blocking, version, timeout=timeout)


def slow_downloader(folder, started, done) -> None:
    """A peer process whose download of ``URL`` has one chunk retried past the read timeout."""
    slow = Storage(slow_chunk_s=1.5)

    async def main():
        # the whole copy: a read is served as soon as its own bytes came (cache/download.py's Downloads), and this
        # peer must stay until its download ends
        first = asyncio.create_task(new_cache(folder, slow, 0.5).ensure(URL, len(BLOB)))
        while slow.reads == 0:
            await asyncio.sleep(0.01)
        started.set()
        await first

    asyncio.run(main())
    done.set()


@pytest.mark.parametrize("processes", [0, 2])
def test_a_retried_chunk_does_not_send_waiting_peers_to_storage(tmp_path, processes):
    """The heartbeat moved only after each chunk: a chunk retried past the read timeout made the
    waiting peers give up, and read that shard from storage for the rest of the run. The peer
    downloads in this process (0) or in a child (2: two processes of a node)."""
    waiting = Storage()
    context = multiprocessing.get_context("fork") if processes else None
    started, done = (context.Event(), context.Event()) if context else (threading.Event(), threading.Event())

    async def main():
        waiter = new_cache(tmp_path, waiting, 0.5)
        if context:
            peer = context.Process(target=slow_downloader, args=(tmp_path, started, done))
            peer.start()
        else:
            peer = asyncio.create_task(asyncio.to_thread(slow_downloader, tmp_path, started, done))
        while not started.is_set():
            await asyncio.sleep(0.01)
        assert await waiter.read_range(URL, 0, 10, len(BLOB)) == BLOB[:10]
        if context:
            await asyncio.to_thread(peer.join, 30)
            assert peer.exitcode == 0
        else:
            await peer
        for _ in range(3):
            assert await waiter.read_range(URL, 10, 20, len(BLOB)) == BLOB[10:20]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(main())
    assert done.is_set()
    assert waiting.reads == 0, "the waiter read storage while its peer was downloading, or after"
    assert not [w for w in caught if "no progress" in str(w.message)]


def test_a_stalled_peer_costs_only_the_reads_it_stalls(tmp_path):
    """A wait that timed out sent the shard to storage for the rest of the run; now only the
    reads while that peer holds its lock unmoved, and the cache is used once it lets go."""
    storage = Storage()
    stalled = try_lock(shard_files(tmp_path, URL).lock)  # a peer that stopped (no heartbeat)

    async def main():
        cache = new_cache(tmp_path, storage, 0.3)
        for _ in range(2):
            assert await cache.read_range(URL, 0, 10, len(BLOB)) == BLOB[:10]
        assert storage.reads == 2 and not cache.path(URL).exists()
        os.close(stalled)  # the peer let go (or died)
        assert await cache.ensure(URL, len(BLOB))  # the whole copy (a read is served before)
        assert cache.path(URL).read_bytes() == BLOB, "the shard was not cached once the peer let go"
        downloaded = storage.reads
        assert await cache.read_range(URL, 10, 20, len(BLOB)) == BLOB[10:20]
        assert storage.reads == downloaded, "a read went to storage although the copy is kept"

    with pytest.warns(RuntimeWarning, match="no progress"):
        asyncio.run(main())


@pytest.mark.parametrize("gated", ["new_file", "write_all", "install"])
def test_a_cancelled_download_lets_its_disk_work_finish(tmp_path, gated):
    """A cancel closed the partial file's descriptor (and released the lock) while a pool thread
    still wrote to it or installed it: the write went to whatever reused the number; a cancel
    during ``new_file`` leaked its descriptor."""
    entered, release = threading.Event(), threading.Event()
    pool = ThreadPoolExecutor(1)

    def held(function):
        def run(*args):
            if function.__name__ == gated:
                entered.set()
                release.wait(10)
            return function(*args)
        return run

    async def run_blocking(function, *args):
        return await asyncio.get_running_loop().run_in_executor(pool, held(function), *args)

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    async def main():
        cache = new_cache(tmp_path, Storage(), 1.0, run_blocking)
        read = asyncio.create_task(cache.read_range(URL, 0, 10, len(BLOB)))
        while not entered.is_set():
            await asyncio.sleep(0.01)
        closing = asyncio.create_task(cache.aclose())
        await asyncio.sleep(0.2)
        done_early = closing.done()
        release.set()
        await closing
        try:
            await read
        except asyncio.CancelledError:
            pass
        await asyncio.sleep(0)
        return done_early

    fds = open_fds()
    try:
        done_early = asyncio.run(main())
    finally:
        release.set()
        pool.shutdown()
    assert not done_early, f"the cancel returned while {gated} still ran on a pool thread"
    assert open_fds() == fds, "a descriptor leaked"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".part")]


def keep(folder, url: str, data: bytes) -> None:
    """A copy of ``url`` with its meta, as a download installs it."""
    names = shard_files(folder, url)
    partial = names.new_part()
    partial.write_bytes(data)
    install(names, partial, {"url": url, "size": len(data), "version": "v1", "crc32": zlib.crc32(data)})


def test_an_eviction_keeps_what_a_peer_installs_meanwhile(tmp_path, monkeypatch):
    """Eviction unlinked copies and meta files without their shard's lock: a peer's copy (or its
    meta) installed between the scan and the unlink was deleted, and downloaded again."""
    old, metaless, busy = "s3://b/old.tar", "s3://b/metaless.tar", "s3://b/busy.tar"
    keep(tmp_path, old, b"old" * 100)
    keep(tmp_path, busy, b"busy" * 100)
    shard_files(tmp_path, metaless).meta.write_text("{}")  # its copy was evicted: a stale meta
    peer = try_lock(shard_files(tmp_path, busy).lock)  # a peer downloading busy's new version
    installed = []

    def racing_try_lock(path):
        for url in (old, metaless):
            if path == shard_files(tmp_path, url).lock and url not in installed:
                installed.append(url)
                keep(tmp_path, url, b"new" * 100)  # a peer installs right after the scan
        return try_lock(path)

    monkeypatch.setattr(cache_evict, "try_lock", racing_try_lock)
    try:
        evict(tmp_path, 0, set())
    finally:
        os.close(peer)
    for url in (old, metaless):
        names = shard_files(tmp_path, url)
        assert names.shard.read_bytes() == b"new" * 100, f"{url}: the peer's fresh copy was deleted"
        assert cache_files.read_meta(names.meta)["crc32"] == zlib.crc32(b"new" * 100), f"{url}: its meta was deleted"
    assert shard_files(tmp_path, busy).shard.exists(), "a copy was deleted while a peer held its lock"


def test_concurrent_downloads_keep_every_copys_meta(tmp_path):
    """One download's eviction deleted, as "no longer kept", the meta of a shard whose download
    ended between its scan and its unlink: the copy stayed without it, and the next run with
    storage down failed that shard's samples (test_cache's storage-down test, 1 run in 6)."""
    urls = [f"s3://b/shard-{number:03d}.tar" for number in range(40)]

    async def download(url, start, end):
        await asyncio.sleep(0.001 * (hash((url, start)) % 5))
        return bytes(end - start)

    async def main(folder):
        cache = ShardCache(folder, 1 << 30, download, 4096, in_thread, version, timeout=5)
        # the whole copies (a read is served before its download ends: cache_progress)
        await asyncio.gather(*(cache.ensure(url, 20480) for url in urls))

    for run in range(3):
        folder = tmp_path / str(run)
        asyncio.run(main(folder))
        lost = [url for url in urls if cache_files.read_meta(shard_files(folder, url).meta) is None]
        assert not lost, f"copies left without their meta: {lost}"


def test_an_eviction_scans_the_folder_once_and_closes_it(tmp_path, monkeypatch):
    """Evicting 200 copies is one scan of the folder, closed (it was one more scan per meta
    file left, 201 in all, most of them left open)."""
    from tests.test_item_cache_bound import CountedScans

    urls = [f"s3://bucket/shard-{index:06d}.tar" for index in range(200)]
    for url in urls:
        names = shard_files(tmp_path, url)
        partial = names.new_part()
        crc = cache_files.write_new(partial, b"x" * 100)
        install(names, partial, {"url": url, "size": 100, "version": "v1", "crc32": crc})
        os.close(try_lock(names.lock))
    counted = CountedScans()
    monkeypatch.setattr(cache_evict.os, "scandir", counted)
    assert evict(tmp_path, 0, set()) is False
    assert counted.scans == 1 and counted.open == set()
    assert list(tmp_path.iterdir()) == []
