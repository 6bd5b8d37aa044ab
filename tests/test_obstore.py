"""obstore, the default client for s3://, against real S3 servers on 127.0.0.1 (SeaweedFS; moto
behind the fault proxy): the options users write are translated, obstore's own are accepted, a
bad one is named, s3fs serves what obstore cannot (or when chosen), and the retries, timeouts
and error names stay asyncload's. Options alone are checked in test_object_store.py."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import psutil
import pytest
import s3fs
import torch

from asyncload import AsyncLoader, ImageDecoder, SampleError, image_folder
from asyncload.io import object_store
from asyncload.io.reader import Reader
from asyncload.stats.loader_stats import LoaderStats
from tests.support.s3server import obstore_options, storage_options
from tests.conftest import CLASSES, PER_CLASS, epoch, identify, setup_s3fs, wait_until
from tests.faults import SLOW_DOWN, STALL, FaultProxy, first_tries

obstore_fsspec = pytest.importorskip("obstore.fsspec")

ALL = sorted((label, index) for label in range(len(CLASSES)) for index in range(PER_CLASS))


def read_epoch(source, options, **kwargs):
    """Every (label, index) delivered in one epoch read with ``options``, and the stats."""
    kwargs.setdefault("batch_size", 6)
    with AsyncLoader(source, decode=ImageDecoder(16), storage_options=options, **kwargs) as loader:
        seen = [identify(image) for images, _ in loader for image in images.numpy()]
    return seen, loader.stats


def reader_filesystem(options, url="s3://asyncload-test/jpegs/cat/0.jpg", timeout=60.0):
    """The filesystem the reader picks for ``url`` with ``options`` (closed again)."""
    loop = asyncio.new_event_loop()
    try:
        reader = Reader(loop, storage_options=options, timeout=timeout, retries=1, io_concurrency=8, stats=LoaderStats())
        fs, _ = reader._filesystem(url)
        loop.run_until_complete(reader.aclose())
        return fs
    finally:
        loop.close()


@pytest.fixture
def source(s3_jpeg_bucket, s3_options):
    return image_folder(s3_jpeg_bucket, storage_options=s3_options)


def test_obstore_reads_and_lists_s3_by_default(s3_options):
    assert isinstance(reader_filesystem(s3_options), obstore_fsspec.FsspecStore)
    fs, path = object_store.url_to_fs("s3://asyncload-test/jpegs", s3_options)
    object_store.release(fs)
    assert isinstance(fs, obstore_fsspec.FsspecStore) and path == "asyncload-test/jpegs"


def test_fsspec_style_options_give_the_local_epoch(jpeg_folder, source, s3_options):
    assert set(s3_options) == {"endpoint_url", "key", "secret"}
    local = epoch(image_folder(str(jpeg_folder)))
    remote = epoch(source, storage_options=s3_options)
    assert len(local) == len(remote) == 5
    for (li, ll), (ri, rl) in zip(local, remote):
        assert torch.equal(ll, rl) and torch.equal(li, ri)


@pytest.mark.parametrize("style", ["nested", "flat"])
def test_obstores_own_options_are_accepted(s3_server, s3_jpeg_bucket, style):
    options = obstore_options(s3_server.endpoint_url)
    if style == "flat":  # from_url's keyword names, at the top level
        options = {**options.pop("config"), **options}
    assert object_store.client_for("s3", options)[0] == "obstore"
    source = image_folder(s3_jpeg_bucket, storage_options=options)
    seen, stats = read_epoch(source, options)
    assert sorted(seen) == ALL and stats.retries == 0


def test_a_misspelt_option_is_named_at_once(s3_jpeg_bucket, s3_options):
    options = {**s3_options, "endpont_url": "http://127.0.0.1:1"}
    with pytest.raises(ValueError, match="storage option 'endpont_url' is not valid for s3://"):
        image_folder(s3_jpeg_bucket, storage_options=options)
    with AsyncLoader([f"{s3_jpeg_bucket}/cat/0.jpg"], batch_size=1, storage_options=options) as loader:
        with pytest.raises(SampleError, match="read: ValueError: storage option 'endpont_url'"):
            list(loader)
    assert loader.stats.retries == 0


def test_an_option_only_s3fs_serves_goes_to_s3fs(source, s3_options):
    options = {**s3_options, "use_ssl": False}
    assert isinstance(reader_filesystem(options), s3fs.S3FileSystem)
    seen, _ = read_epoch(source, options)
    assert sorted(seen) == ALL
    with pytest.raises(ValueError, match="obstore cannot serve 'use_ssl'; use client='fsspec'"):
        image_folder("s3://asyncload-test/jpegs", storage_options={**options, "client": "obstore"})


def test_s3fs_is_chosen_with_client_fsspec(s3_jpeg_bucket, s3_options):
    options = {**s3_options, "client": "fsspec"}
    assert isinstance(reader_filesystem(options), s3fs.S3FileSystem)
    fs, _ = object_store.url_to_fs(s3_jpeg_bucket, options)
    object_store.release(fs)
    assert isinstance(fs, s3fs.S3FileSystem)
    seen, _ = read_epoch(image_folder(s3_jpeg_bucket, storage_options=options), options)
    assert sorted(seen) == ALL


def test_credentials_from_an_aws_profile(s3_server, source, tmp_path, monkeypatch):
    """``profile`` reads ``~/.aws`` (here AWS_SHARED_CREDENTIALS_FILE) through boto3, as s3fs does."""
    pytest.importorskip("boto3")
    (tmp_path / "credentials").write_text("[asyncload]\naws_access_key_id = from-profile\naws_secret_access_key = s\n")
    (tmp_path / "config").write_text("[profile asyncload]\nregion = eu-west-3\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    options = {"endpoint_url": s3_server.endpoint_url, "profile": "asyncload"}
    _, settings = object_store.client_for("s3", options)
    provider = settings["credential_provider"]
    assert provider()["access_key_id"] == "from-profile" and provider.config == {"region": "eu-west-3"}
    seen, _ = read_epoch(source, options)
    assert sorted(seen) == ALL
    monkeypatch.setenv("AWS_PROFILE", "asyncload")  # no options: the profile of the environment
    assert object_store.client_for("s3", {})[1]["credential_provider"]()["access_key_id"] == "from-profile"


def test_a_missing_object_names_its_url_and_is_not_retried(s3_jpeg_bucket, s3_options):
    url = f"{s3_jpeg_bucket}/cat/no-such-image.jpg"
    with AsyncLoader([url], batch_size=1, storage_options=s3_options) as loader:
        with pytest.raises(SampleError, match="no-such-image.jpg.*read: FileNotFoundError"):
            list(loader)
    assert loader.stats.retries == 0


def test_whole_objects_and_ranges_come_back_exactly_empty_ones_too(s3_jpeg_bucket, s3_options):
    """The reader reads a whole object as one ranged GET to its end; an empty object has no byte
    to range over (the server answers 416) and must still read as b"" without a retry."""
    import os

    objects = {f"asyncload-test/raw/{size}": os.urandom(size) for size in (0, 1, 100_000)}
    with setup_s3fs(s3_options) as put:
        put.pipe(objects)
    stats = LoaderStats()
    loop = asyncio.new_event_loop()
    try:
        reader = Reader(loop, storage_options=s3_options, timeout=30.0, retries=2, io_concurrency=8, stats=stats)
        for path, data in objects.items():
            assert loop.run_until_complete(reader.read(f"s3://{path}")) == data
        big = objects["asyncload-test/raw/100000"]
        assert loop.run_until_complete(reader.read_range("s3://asyncload-test/raw/100000", 10, 70_000)) == big[10:70_000]
        loop.run_until_complete(reader.aclose())
    finally:
        loop.close()
    assert stats.retries == 0


def test_a_server_that_ignores_ranges_is_read_with_plain_gets():
    """A server (or proxy) that answers the whole-object ranged GET with a full 200 body: the
    object is read with a plain GET, and every later one straight away (one request each)."""
    import http.server
    import threading

    body, ranges = b"x" * 1000, []

    class IgnoresRanges(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            ranges.append(self.headers.get("Range"))
            self.send_response(200)
            for name, value in (("Content-Length", str(len(body))), ("ETag", '"e"'),
                                ("Last-Modified", "Mon, 23 Nov 2026 10:00:00 GMT")):
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), IgnoresRanges)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    options = {"endpoint_url": f"http://127.0.0.1:{server.server_port}", "key": "k", "secret": "s", "region": "us-east-1"}
    stats, loop = LoaderStats(), asyncio.new_event_loop()
    try:
        reader = Reader(loop, storage_options=options, timeout=10.0, retries=0, io_concurrency=4, stats=stats)
        assert [loop.run_until_complete(reader.read(f"s3://bucket/{i}.jpg")) for i in range(3)] == [body] * 3
        loop.run_until_complete(reader.aclose())
    finally:
        loop.close()
        server.shutdown()
        server.server_close()
    assert ranges[0] is not None and ranges[1:] == [None] * 3
    assert stats.retries == 0


@pytest.fixture
def moto_source(moto_server, moto_jpeg_bucket):
    return image_folder(moto_jpeg_bucket, storage_options=storage_options(moto_server.endpoint_url))


def test_access_denied_keeps_obstores_error_chained(moto_server, moto_source):
    denied = (403, "AccessDenied", "Access Denied")
    with FaultProxy(moto_server.port, first_tries(denied, tries=100)) as proxy:
        with AsyncLoader(moto_source, batch_size=4, decode=ImageDecoder(16), shuffle=False,
                         storage_options=storage_options(proxy.endpoint_url)) as loader:
            with pytest.raises(SampleError, match=r"'s3://asyncload-test/jpegs/cat/0.jpg' failed at read: PermissionError") as caught:
                list(loader)
    assert type(caught.value.cause.__cause__).__name__ == "PermissionDeniedError", "obstore's error stays chained"
    assert loader.stats.retries == 0


def test_a_retry_config_of_the_users_is_kept(moto_server, moto_source):
    with FaultProxy(moto_server.port, first_tries(SLOW_DOWN, tries=2)) as proxy:
        options = {**storage_options(proxy.endpoint_url),
                   "retry_config": {"max_retries": 2, "backoff": {"init_backoff": timedelta(milliseconds=10)}}}
        seen, stats = read_epoch(moto_source, options)
    assert sorted(seen) == ALL
    assert stats.retries == 0, "obstore retried, as asked"


def test_the_timeout_that_ends_a_stalled_read_is_ours(moto_server, moto_source):
    """Ours raises TimeoutError; obstore's own would raise its GenericError."""
    with FaultProxy(moto_server.port, first_tries(STALL, tries=100)) as proxy:
        with AsyncLoader(moto_source, batch_size=4, decode=ImageDecoder(16), read_timeout=0.5, read_retries=0,
                         storage_options=storage_options(proxy.endpoint_url)) as loader:
            with pytest.raises(SampleError, match="failed at read: TimeoutError"):
                list(loader)


def test_obstores_own_request_timeout_is_above_ours(s3_options):
    """obstore ends a request at 30 s by default, before our 60 s would; ours must fire first
    (the user's own setting wins)."""
    assert reader_filesystem(s3_options)._client_options["timeout"] == timedelta(seconds=61)
    assert reader_filesystem(s3_options)._retry_config == {"max_retries": 0}
    mine = {**s3_options, "client_options": {"timeout": "5s"}}
    assert reader_filesystem(mine)._client_options == {"timeout": "5s", "allow_http": True}


def connections_to(port: int) -> set[int]:
    """This process's open connections to ``port``, by local port."""
    return {c.laddr.port for c in psutil.Process().net_connections("tcp")
            if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED}


def test_close_leaves_no_connection_open(s3_server, source, s3_options):
    """obstore keeps connections alive in a pool per bucket (SeaweedFS keeps them too); closing
    the loader closes them. Only the loader's own are counted: a filesystem another test dropped
    keeps its connections until a GC."""
    before = connections_to(s3_server.port)
    with AsyncLoader(source, batch_size=2, prefetch=1, decode=ImageDecoder(16), storage_options=s3_options) as loader:
        seen = []
        for number, (images, _) in enumerate(loader):
            seen += [identify(image) for image in images.numpy()]
            if number == 0:  # reads wait for free buffers: the pool is still open
                assert connections_to(s3_server.port) - before
    assert sorted(seen) == ALL
    assert wait_until(lambda: not connections_to(s3_server.port) - before, timeout=5), \
        f"{len(connections_to(s3_server.port) - before)} left open"


@pytest.mark.parametrize("client", ["obstore", "fsspec"])
def test_listing_a_bucket_leaves_no_connection_open(s3_server, s3_jpeg_bucket, s3_options, client):
    """image_folder lists through obstore or s3fs; both keep connections alive until their
    filesystem is collected unless the listing closes them."""
    before = connections_to(s3_server.port)
    assert len(image_folder(s3_jpeg_bucket, storage_options={**s3_options, "client": client})) == len(ALL)
    assert wait_until(lambda: not connections_to(s3_server.port) - before, timeout=5), \
        f"{len(connections_to(s3_server.port) - before)} left open"


MESSAGE_CHARS = 400  # a SampleError is a line: the item, the stage, the cause in at most ~200, the attempts


def read_failure(url: str, options: dict, **kwargs) -> SampleError:
    with AsyncLoader([url], batch_size=1, decode=ImageDecoder(16), storage_options=options, **kwargs) as loader:
        with pytest.raises(SampleError) as caught:
            list(loader)
    return caught.value


def assert_one_short_line(error: SampleError, url: str) -> None:
    message = str(error)
    assert len(message.splitlines()) == 1 and len(message) <= MESSAGE_CHARS, message
    assert message.startswith(f"sample {url!r} failed at read: "), message
    assert "Debug source" not in message and "RetryErrorImpl" not in message, message
    assert "Debug source" in str(error.__cause__), "the client's whole text stays on __cause__"


def test_a_missing_key_is_one_line_naming_the_url_and_the_cause(s3_jpeg_bucket, s3_options):
    """obstore's text is its message, the S3 error document and a Rust debug dump of the client's
    error (over 1,300 characters on ~25 lines); the message keeps the code and its meaning."""
    url = f"{s3_jpeg_bucket}/missing.jpg"
    error = read_failure(url, s3_options)
    assert_one_short_line(error, url)
    assert "FileNotFoundError" in str(error) and "404 Not Found: NoSuchKey: The specified key does not exist." in str(error)


def test_a_closed_port_is_one_line_naming_the_url_the_cause_and_the_attempts(s3_options):
    """At a port nobody listens on, the reason ("Connection refused") is at the end of the dump,
    ~37 lines below the first."""
    from tests.support.s3server import free_port

    url = "s3://asyncload-test/jpegs/cat/0.jpg"
    error = read_failure(url, {**s3_options, "endpoint_url": f"http://127.0.0.1:{free_port()}"}, read_retries=1)
    assert_one_short_line(error, url)
    assert "error sending request (Connection refused)" in str(error) and "attempt 2" in str(error), str(error)
