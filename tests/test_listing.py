"""Listing a bucket prefix and reading a manifest (``sources/listing.py``): what is not there
is a FileNotFoundError or a ValueError naming the URL and what was looked for; storage that
fails is retried with the reader's timeout and retries (given, or named by the storage
options), then a short ``StorageError`` naming the URL and the attempts."""

from __future__ import annotations

import inspect
import socket
import threading
import time
from datetime import timedelta

import pytest

from asyncload import AsyncLoader, StorageError, image_folder, list_files, manifest, tar_shards
from asyncload.io import object_store
from asyncload.io.store_options import obstore_settings
from tests.support.s3server import storage_options
from tests.conftest import CLASSES, PER_CLASS, setup_s3fs
from tests.test_sources import EXTENSIONS, raised
from tests.faults import PASS, SLOW_DOWN, STALL, FaultProxy

CLIENTS = ["obstore", "fsspec"]  # obstore's FsspecStore, s3fs


@pytest.fixture
def silent_endpoint():
    """An S3 endpoint on 127.0.0.1 that accepts every connection and never answers; yields its
    storage options and the list of connections it accepted."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.05)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except TimeoutError:
                pass

    thread = threading.Thread(target=accept, name="silent-endpoint")
    thread.start()
    try:
        yield storage_options(f"http://127.0.0.1:{server.getsockname()[1]}"), accepted
    finally:
        stop.set()
        thread.join()
        for connection in accepted:
            connection.close()
        server.close()


def storage_error(call, *args, **kwargs) -> tuple[StorageError, float]:
    started = time.monotonic()
    with pytest.raises(StorageError) as caught:
        call(*args, **kwargs)
    return caught.value, time.monotonic() - started


@pytest.mark.parametrize("client", CLIENTS)
def test_listing_a_silent_endpoint_fails_after_the_timeout_and_retries_given(silent_endpoint, client):
    options, accepted = silent_endpoint
    error, seconds = storage_error(image_folder, "s3://bucket/train", storage_options={**options, "client": client},
                                   timeout=1, retries=1)
    assert 2 <= seconds < 30  # two requests of 1 s and a pause, not obstore's 10 x 30 s (loose for a busy box)
    message = str(error)
    assert message.startswith("listing s3://bucket/train failed after 2 attempts: ") and len(message) <= 400
    assert isinstance(error, OSError) and error.__cause__ is not None and not isinstance(error.__cause__, StorageError)
    assert len(accepted) == 2  # the client retried nothing by itself: every attempt is counted


@pytest.mark.parametrize("client", CLIENTS)
def test_reading_a_manifest_takes_the_timeout_and_retries_the_storage_options_name(silent_endpoint, client):
    """s3fs's ``config_kwargs`` read_timeout and retries, as users write them, bound the read."""
    options, accepted = silent_endpoint
    named = {**options, "client": client, "config_kwargs": {"read_timeout": 1, "retries": {"max_attempts": 0}}}
    error, seconds = storage_error(manifest, "s3://bucket/train.tsv", storage_options=named)
    assert seconds < 20  # the 1 s named, not a default of 60 s (loose for a busy box)
    assert str(error).startswith("reading s3://bucket/train.tsv failed after 1 attempt: ") and len(str(error)) <= 400
    assert error.__cause__ is not None and len(accepted) == 1


def test_keyword_arguments_win_over_the_storage_options(silent_endpoint):
    options, accepted = silent_endpoint
    named = {**options, "config_kwargs": {"read_timeout": 30, "retries": {"max_attempts": 5}}}
    error, seconds = storage_error(list_files, "s3://bucket/images", storage_options=named, timeout=0.5, retries=0)
    assert seconds < 20 and "failed after 1 attempt" in str(error) and len(accepted) == 1


@pytest.mark.parametrize("client, fault", [("obstore", STALL), ("obstore", SLOW_DOWN), ("fsspec", STALL)],
                         ids=["obstore-stall", "obstore-503", "fsspec-stall"])
def test_a_listing_recovers_from_a_stalled_or_throttled_request(s3_server, s3_jpeg_bucket, client, fault):
    """The first list request stalls (or is throttled); the listing's retry gets every image.
    (The proxy sees the first request of each connection: SeaweedFS keeps connections alive.)"""
    lists: list[str] = []

    def first_list_fails(line: str, count: int):
        if not (line.startswith("GET /asyncload-test?") and "list-type=2" in line):
            return PASS
        lists.append(line)
        return fault if len(lists) == 1 else PASS

    with FaultProxy(s3_server.port, first_list_fails) as proxy:
        options = {**storage_options(proxy.endpoint_url), "client": client}
        source = image_folder(s3_jpeg_bucket, storage_options=options, timeout=1, retries=1)
    assert source.classes == list(CLASSES) and len(source) == len(CLASSES) * PER_CLASS
    assert lists[1] == lists[0]  # the failed request was made again


def test_config_kwargs_timeouts_reach_obstores_client():
    settings = obstore_settings("s3", {"endpoint_url": "http://127.0.0.1:9", "config_kwargs": {
        "read_timeout": 5, "connect_timeout": 2, "retries": {"max_attempts": 3}}})
    assert settings["client_options"]["timeout"] == timedelta(seconds=5)
    assert settings["client_options"]["connect_timeout"] == timedelta(seconds=2)


def test_listing_defaults_are_the_loaders_read_timeout_and_retries():
    loader = inspect.signature(AsyncLoader).parameters
    assert object_store.LISTING_TIMEOUT_S == loader["read_timeout"].default
    assert object_store.LISTING_RETRIES == 6 and loader["read_retries"].default is None  # reads: by time
    fs, _ = object_store.url_to_fs("s3://bucket/train", {"anon": True, "region": "us-east-1"}, listing=True)
    assert fs._client_options["timeout"] == timedelta(seconds=object_store.LISTING_TIMEOUT_S)
    assert fs._retry_config == {"max_retries": 0}


@pytest.fixture(scope="module")
def listing_bucket(s3_options):
    """``s3://asyncload-listing`` on SeaweedFS: ``notes/a/readme.txt`` (no image) and
    ``loose/0.jpg`` (an image in no class folder)."""
    with setup_s3fs(s3_options) as fs:
        if not fs.exists("asyncload-listing"):
            fs.mkdir("asyncload-listing")
        fs.pipe_file("asyncload-listing/notes/a/readme.txt", b"not an image")
        fs.pipe_file("asyncload-listing/loose/0.jpg", b"\xff\xd8")
    return "s3://asyncload-listing"


@pytest.mark.parametrize("client", CLIENTS)
def test_an_empty_prefix_or_a_missing_bucket_is_not_found(s3_options, listing_bucket, client):
    options = {**s3_options, "client": client}
    for url in (f"{listing_bucket}/no-such-prefix", "s3://asyncload-no-such-bucket/train"):
        missing = f"{url}: no such bucket, or no object under that prefix (looked for "
        assert raised(FileNotFoundError, image_folder, url, storage_options=options) == (
            f"{missing}class folders holding files ending in {EXTENSIONS})")
        assert raised(FileNotFoundError, list_files, url, storage_options=options) == (
            f"{missing}files ending in {EXTENSIONS})")
    for url in (f"{listing_bucket}/train.tsv", "s3://asyncload-no-such-bucket/train.tsv"):
        assert raised(FileNotFoundError, manifest, url, storage_options=options) == f"manifest {url} not found"


@pytest.mark.parametrize("client", CLIENTS)
def test_a_prefix_without_images_in_class_folders_is_a_value_error(s3_options, listing_bucket, client):
    options = {**s3_options, "client": client}
    notes, loose = f"{listing_bucket}/notes", f"{listing_bucket}/loose"
    assert raised(ValueError, image_folder, notes, storage_options=options) == (
        f"{notes}: looked for class folders holding files ending in {EXTENSIONS} (<class>/<file>), found none")
    assert raised(ValueError, list_files, notes, storage_options=options, extensions=(".npy",)) == (
        f"{notes}: looked for files ending in .npy, found none")
    assert raised(ValueError, image_folder, loose, storage_options=options).endswith(
        "found only 1 at its top level, in no class folder")
    assert list(list_files(loose, storage_options=options)) == [f"{loose}/0.jpg"]


@pytest.mark.parametrize("client", CLIENTS)
def test_a_shard_index_on_a_silent_endpoint_fails_after_the_timeout_and_retries_given(silent_endpoint, client):
    """tar_shards read its index with the client's own terms: still waiting after 75 s."""
    options, accepted = silent_endpoint
    error, seconds = storage_error(tar_shards, "s3://bucket/train", storage_options={**options, "client": client},
                                   timeout=1, retries=1)
    assert 2 <= seconds < 30  # not the client's own terms (loose for a busy box)
    assert str(error).startswith("reading s3://bucket/train/index.json failed after 2 attempts: ")
    assert len(accepted) == 2


def test_a_missing_shard_index_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"shard index {tmp_path}/index.json not found"):
        tar_shards(str(tmp_path))
