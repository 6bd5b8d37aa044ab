"""The shard cache on a shared node and through faults (cache/shards.py, cache/files.py): it
touches only its own files, never waits longer than the read timeout, and keeps the epoch going
while storage is down, the disk is full or a copy is damaged. Against the real S3 server."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import stat
import subprocess
import threading
import warnings

import pytest

from asyncload import AsyncLoader, ImageDecoder, SampleError, image_folder, parquet, tar_shards, write_parquet
from asyncload.cache.files import shard_files
from tests.support.s3server import storage_options
from tests.conftest import CLASSES, PER_CLASS, delivered, flat, make_bucket, setup_s3fs, wait_until

ALL = sorted((label, index) for label in range(len(CLASSES)) for index in range(PER_CLASS))
DECODE = ImageDecoder(32)


@pytest.fixture()
def shards(s3_options, shard_dir, request):
    """``(url, s3fs, prefix)`` of the shard set uploaded to a prefix of this test's own."""
    prefix = f"asyncload-test/cache/{request.node.name.replace('[', '-').strip(']')}"
    with setup_s3fs(s3_options) as fs:
        make_bucket(fs)
        for path in sorted(shard_dir.iterdir()):
            fs.pipe_file(f"{prefix}/{path.name}", path.read_bytes())
        yield f"s3://{prefix}", fs, prefix


def epoch(source, options, processes=0, epochs=1, **kwargs) -> list:
    """Every sample of one epoch, sorted, each checked against its label (``delivered``); with
    ``epochs``, every sample of each, in one loader."""
    with AsyncLoader(source, batch_size=8, decode=DECODE, storage_options=options, processes=processes,
                     **kwargs) as loader:
        return [sample for _ in range(epochs) for sample in sorted(flat(delivered(loader)))]


def closed_port_options() -> dict:
    """Storage options for an S3 endpoint nobody listens on (storage down)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return storage_options(f"http://127.0.0.1:{port}")


def copies(cache) -> list:
    return sorted(p for p in cache.iterdir() if p.name.startswith("asyncload-") and p.name.endswith(".tar")
                  and not p.is_symlink())


@pytest.mark.parametrize("processes", [0, 2])
def test_kept_copies_serve_the_epoch_while_storage_is_down(shards, s3_options, tmp_path, processes):
    """Every run asked storage for each shard's version before using its copy: with the server
    down, 0 of the samples came. Now a copy whose checksum holds is used."""
    url, _, _ = shards
    source = tar_shards(url, storage_options=s3_options, cache_dir=str(tmp_path))
    assert epoch(source, s3_options) == ALL
    assert len(copies(tmp_path)) == 5
    warned = pytest.warns(RuntimeWarning, match="could not be asked")
    with warned if processes == 0 else contextlib.nullcontext():  # a child's warning stays in the child
        assert epoch(source, closed_port_options(), processes, read_retries=1) == ALL


def test_an_object_gone_from_storage_still_fails_its_samples(shards, s3_options, tmp_path):
    """Storage that answers "not found" is not storage that cannot be asked: the copy is not used."""
    url, fs, prefix = shards
    source = tar_shards(url, storage_options=s3_options, cache_dir=str(tmp_path))
    assert epoch(source, s3_options) == ALL
    fs.rm_file(f"{prefix}/shard-000002.tar")
    with pytest.raises(SampleError) as caught:
        epoch(source, s3_options)
    assert isinstance(caught.value.__cause__, FileNotFoundError), caught.value


@pytest.mark.parametrize("processes", [0, 2])
def test_a_damaged_copy_is_downloaded_again(shards, s3_options, tmp_path, processes):
    """A copy overwritten with garbage of the same size was served on every run (all its samples
    failed to decode until the user deleted it): its checksum now sends it back to storage."""
    url, _, _ = shards
    source = tar_shards(url, storage_options=s3_options, cache_dir=str(tmp_path))
    assert epoch(source, s3_options) == ALL
    damaged = copies(tmp_path)[1]
    damaged.write_bytes(os.urandom(damaged.stat().st_size))
    assert epoch(source, s3_options, processes, epochs=2) == ALL * 2  # the second: the copy downloaded again


@pytest.mark.parametrize("processes", [0, 2])
def test_files_that_are_not_the_caches_are_left_alone(shards, s3_options, tmp_path, processes):
    """Eviction deleted a user's older file in cache_dir, and an older sub-folder there made
    every sample fail (IsADirectoryError); symlinks planted at the cache's names were followed."""
    url, _, _ = shards
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "notes.txt").write_text("mine")
    (cache / "old-run").mkdir()
    (cache / "old-run" / "weights.pt").write_bytes(b"weights")
    outside = tmp_path / "victim"
    outside.write_text("do not touch")
    (cache / "link-out").symlink_to(outside)
    for path in (cache / "notes.txt", cache / "old-run", cache / "link-out"):
        os.utime(path, (1, 1), follow_symlinks=False)  # older than anything the cache writes
    source = tar_shards(url, storage_options=s3_options, cache_dir=str(cache), cache_bytes=45_000)  # two shards
    planted = shard_files(cache, source.urls[3])
    for name in (planted.meta, planted.lock):  # a peer's symlinks at the cache's own names
        name.symlink_to(tmp_path / f"made-{name.suffix[1:]}")
    planted.shard.symlink_to(outside)
    assert epoch(source, s3_options, processes) == ALL
    assert (cache / "notes.txt").read_text() == "mine"
    assert (cache / "old-run" / "weights.pt").read_bytes() == b"weights"
    assert (cache / "link-out").is_symlink() and outside.read_text() == "do not touch"
    assert not (tmp_path / "made-meta").exists() and not (tmp_path / "made-lock").exists(), "a symlink was followed"
    assert sum(p.stat().st_size for p in copies(cache)) <= 45_000


def test_files_are_created_with_the_users_umask(shards, s3_options, tmp_path):
    """Lock files were 0644 whatever the umask: a node's users sharing the folder with umask 002
    could not replace each other's files."""
    url, _, _ = shards
    old = os.umask(0o002)
    try:
        source = tar_shards(url, storage_options=s3_options, cache_dir=str(tmp_path))
        assert epoch(source, s3_options) == ALL
    finally:
        os.umask(old)
    files = shard_files(tmp_path, source.urls[0])
    for path in (files.shard, files.meta, files.lock):
        assert stat.S_IMODE(path.stat().st_mode) == 0o664, path


def test_shard_names_of_any_length_fit(s3_options, shard_dir, tmp_path):
    """A 250-character shard name failed every sample (ENAMETOOLONG): the cache's names add to it."""
    long = "n" * 246
    index = json.loads((shard_dir / "index.json").read_text())
    with setup_s3fs(s3_options) as fs:
        make_bucket(fs)
        for number, shard in enumerate(index["shards"]):
            fs.pipe_file(f"asyncload-test/long/{long}{number}.tar", (shard_dir / shard["url"]).read_bytes())
            shard["url"] = f"{long}{number}.tar"
        fs.pipe_file("asyncload-test/long/index.json", json.dumps(index).encode())
    source = tar_shards("s3://asyncload-test/long", storage_options=s3_options, cache_dir=str(tmp_path))
    assert epoch(source, s3_options) == ALL
    assert len(copies(tmp_path)) == 5 and all(len(p.name) < 255 for p in tmp_path.iterdir())


@pytest.mark.parametrize("processes", [0, 2])
def test_a_stalled_peer_holding_a_lock_does_not_stall_the_loader(shards, s3_options, tmp_path, processes):
    """A peer holding a shard's lock and doing nothing made every loader wait on the flock for
    ever; now a wait with no progress ends after the read timeout, and the shard is read from
    storage."""
    url, _, _ = shards
    source = tar_shards(url, storage_options=s3_options, cache_dir=str(tmp_path))
    locks = [os.open(shard_files(tmp_path, shard).lock, os.O_CREAT | os.O_RDWR) for shard in source.urls]
    result: dict = {}

    def run():
        try:
            result["samples"] = epoch(source, s3_options, processes, read_timeout=1)
        except BaseException as error:  # noqa: BLE001 (reported below)
            result["error"] = error

    try:
        for lock in locks:
            fcntl.flock(lock, fcntl.LOCK_EX)  # as a stalled peer process would
        thread = threading.Thread(target=run)
        thread.start()
        thread.join(60)  # the waits end after ~1 s each; 60 s only on a box far too loaded
        stalled = thread.is_alive()
    finally:
        for lock in locks:
            os.close(lock)
    thread.join()
    assert not stalled, "the loader waited on a stalled peer's lock"
    assert result.get("samples") == ALL, result.get("error")
    assert copies(tmp_path) == []


@pytest.fixture()
def small_disk(tmp_path):
    """A 32 KiB tmpfs: room for one 20 KiB shard of the five, not two."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32k", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


@pytest.mark.parametrize("processes", [0, 2])
@pytest.mark.parametrize("cache_bytes", [1 << 30, None])
def test_a_full_disk_sends_reads_to_storage(shards, s3_options, small_disk, processes, cache_bytes):
    """A disk too small for the shards failed the epoch (ENOSPC) and was left full. Now a shard
    that does not fit is read from storage, its partial file removed. ``cache_bytes=None``
    follows the disk's free space (half of it: no shard fits, nothing is written)."""
    url, _, _ = shards
    source = tar_shards(url, storage_options=s3_options, cache_dir=str(small_disk), cache_bytes=cache_bytes)
    assert epoch(source, s3_options, processes, epochs=2) == ALL * 2
    assert not [p for p in small_disk.iterdir() if p.name.endswith(".part")]
    assert len(copies(small_disk)) <= 1 if cache_bytes else copies(small_disk) == []
    disk = os.statvfs(small_disk)
    assert disk.f_bavail * disk.f_frsize >= 32768 - 20480 - 4096, "the disk was left full"



def test_a_peer_that_shows_progress_is_waited_for(shards, s3_options, tmp_path):
    """The read timeout bounds a wait without progress, not a download: a peer whose heartbeat
    (its lock file's modification time, touched from a timer while it holds it) moves is waited for."""
    url, _, _ = shards
    source = tar_shards(url, storage_options=s3_options, cache_dir=str(tmp_path))
    lock = os.open(shard_files(tmp_path, source.urls[0]).lock, os.O_CREAT | os.O_RDWR)
    fcntl.flock(lock, fcntl.LOCK_EX)
    stop = threading.Event()

    def peer():  # downloads slowly for ~2 read timeouts, then gives up without a copy
        for _ in range(8):
            if stop.wait(0.25):
                break
            os.utime(lock)
        os.close(lock)

    thread = threading.Thread(target=peer)
    thread.start()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert epoch(source, s3_options, read_timeout=1) == ALL
    finally:
        stop.set()
        thread.join()
    assert not [w for w in caught if "no progress" in str(w.message)]
    assert len(copies(tmp_path)) == 5, "the shard was read from storage instead of waited for"


def test_a_copy_used_while_storage_was_down_is_checked_again_when_it_answers(tmp_path, monkeypatch):
    """Storage down: the copy serves. Storage back with the object rewritten: downloaded again."""
    import asyncio

    from asyncload.cache import offline as offline_module
    from asyncload.cache.shards import ShardCache

    remote = {"data": bytes(range(256)) * 8, "version": "v1", "down": False}

    async def download(url, start, end):
        return remote["data"][start:end]

    async def version(url):
        if remote["down"]:
            raise ConnectionRefusedError("storage is down")
        return remote["version"]

    async def run_blocking(function, *args):
        return function(*args)

    def new_cache():
        return ShardCache(tmp_path, 1 << 20, download, 1000, run_blocking, version=version, timeout=1)

    async def read(cache):
        return await cache.read_range("s3://b/shard.tar", 0, 2048, 2048)

    first = remote["data"]
    assert asyncio.run(read(new_cache())) == first
    remote.update(down=True, data=bytes(2048), version="v2")  # rewritten while storage is down
    monkeypatch.setattr(offline_module, "OFFLINE_S", 0.0)  # ask again at the next read
    cache = new_cache()
    with pytest.warns(RuntimeWarning, match="could not be asked"):
        assert asyncio.run(read(cache)) == first
    remote["down"] = False
    assert asyncio.run(read(cache)) == bytes(2048)


def rot(path) -> None:
    """Overwrites ``path`` with garbage of its size, keeping its times (bit rot: the once-per-process
    checksum, keyed by the file's modification time, does not see it)."""
    info = path.stat()
    path.write_bytes(os.urandom(info.st_size))
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns))


@pytest.mark.parametrize("processes", [0, 2])
def test_a_copy_damaged_after_its_check_is_downloaded_again(shards, s3_options, tmp_path, processes):
    """A copy checked at its first use and damaged afterwards failed all its samples for the rest
    of the run; now their failed decodes send it back to storage, and each is decoded again."""
    url, _, _ = shards
    source = tar_shards(url, storage_options=s3_options, cache_dir=str(tmp_path))
    assert epoch(source, s3_options) == ALL  # downloads every copy
    with AsyncLoader(source, batch_size=8, decode=DECODE, storage_options=s3_options, processes=processes) as loader:
        assert sorted(flat(delivered(loader))) == ALL  # checks every copy (its checksum), once per process
        damaged = copies(tmp_path)[1]
        good, checked = damaged.read_bytes(), damaged.stat().st_mtime_ns
        rot(damaged)
        assert sorted(flat(delivered(loader))) == ALL  # each once, none failed
    assert damaged.read_bytes() == good and damaged.stat().st_mtime_ns != checked, "the copy was not downloaded again"


@pytest.mark.parametrize("processes", [0, 2])
def test_a_parquet_copy_damaged_after_its_check_is_downloaded_again(s3_options, jpeg_folder, tmp_path, processes):
    """As above, where the damage shows as a row group that does not parse (a whole read failed)."""
    with setup_s3fs(s3_options) as fs:
        make_bucket(fs)
    url = write_parquet(image_folder(str(jpeg_folder)), f"s3://asyncload-test/cache-parquet/{processes}.parquet",
                        rows_per_group=6, storage_options=s3_options)
    source = parquet(url, storage_options=s3_options, cache_dir=str(tmp_path))
    assert epoch(source, s3_options) == ALL
    with AsyncLoader(source, batch_size=8, decode=DECODE, storage_options=s3_options, processes=processes) as loader:
        assert sorted(flat(delivered(loader))) == ALL
        (copy,) = [path for path in tmp_path.iterdir() if path.name.endswith(".parquet")]
        good, checked = copy.read_bytes(), copy.stat().st_mtime_ns
        rot(copy)
        assert sorted(flat(delivered(loader))) == ALL
    assert copy.read_bytes() == good and copy.stat().st_mtime_ns != checked, "the copy was not downloaded again"


@pytest.mark.parametrize("processes", [0, 2])
@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_an_object_bad_in_storage_fails_its_samples_without_refetching(shards, s3_options, tmp_path, processes,
                                                                        on_error):
    """Garbage in the bucket: its copy holds its checksum, so its samples fail (or are skipped) as
    they would without a cache, in each epoch; the copy is downloaded once, never again."""
    url, fs, _ = shards
    source = tar_shards(url, storage_options=s3_options, cache_dir=str(tmp_path))
    bad = source.urls[2]
    fs.pipe_file(bad[len("s3://"):], os.urandom(int(source.shard_bytes[2])))
    copy, downloads = shard_files(tmp_path, bad).shard, set()
    with AsyncLoader(source, batch_size=8, decode=DECODE, storage_options=s3_options, processes=processes,
                     on_error=on_error, max_failures=10) as loader:
        for _ in range(2):
            if on_error == "raise":
                with pytest.raises(SampleError, match="failed at decode") as caught:
                    list(loader)
                assert caught.value.item.shard == bad
            else:
                samples = flat(delivered(loader))
                assert len(samples) == len(ALL) - 5 and set(samples) < set(ALL)
                failures = loader.stats.failures[-5:]
                assert len({error.item.key for error in failures}) == 5 and {error.item.shard for error in failures} == {bad}
            # With "raise" the pass ends at the first sample that fails, which may be served from the
            # download under way: the download goes on past the pass (it ends with the loader) and
            # installs the copy when it completes (on a loaded box, after the raise: a CI flake).
            assert wait_until(copy.exists, timeout=10), "the download under way completes"
            downloads.add((copy.stat().st_ino, copy.stat().st_mtime_ns))
    assert len(downloads) == 1, "the copy of a bad object was downloaded again"
