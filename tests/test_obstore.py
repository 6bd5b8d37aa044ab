"""s3:// through obstore (``obstore.fsspec.register("s3")``) against the real S3 server on
127.0.0.1: same pixels as from disk, errors named as with s3fs, our retries and timeouts the only
ones, ranged reads for tar shards, and nothing left open after close."""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
import time
from datetime import timedelta

import fsspec
import psutil
import pytest
import torch
from fsspec.registry import _registry

from asyncload import AsyncLoader, ImageDecoder, SampleError, image_folder, tar_shards, write_shards
from asyncload.read import Reader
from asyncload.stats import LoaderStats
from bench.s3server import LatencyProxy, free_port, obstore_options
from tests.conftest import CLASSES, PER_CLASS, epoch, identify, make_bucket, wait_until
from tests.faults import RESET, SLOW_DOWN, STALL, FaultProxy, first_tries

obstore_fsspec = pytest.importorskip("obstore.fsspec")

ALL = sorted((label, index) for label in range(len(CLASSES)) for index in range(PER_CLASS))
DECODE = ImageDecoder(24)


@contextlib.contextmanager
def obstore_for_s3():
    """``obstore.fsspec.register("s3")`` inside; fsspec's registry for "s3" as it was after."""
    saved = _registry.get("s3")
    obstore_fsspec.register("s3")
    try:
        yield
    finally:
        fsspec.get_filesystem_class("s3").clear_instance_cache()  # listings' stores and pools
        if saved is None:
            _registry.pop("s3", None)
        else:
            _registry["s3"] = saved


@pytest.fixture
def obstore_s3(s3_server) -> dict:
    """s3:// read by obstore for this test; its storage options for the test server."""
    with obstore_for_s3():
        yield obstore_options(s3_server.endpoint_url)


@pytest.fixture
def source(s3_jpeg_bucket, obstore_s3):
    """The JPEG bucket, listed through obstore."""
    return image_folder(s3_jpeg_bucket, storage_options=obstore_s3)


def read_epoch(source, endpoint_url, **kwargs):
    """Every (label, index) delivered in one epoch read from ``endpoint_url``, and the stats."""
    kwargs.setdefault("storage_options", obstore_options(endpoint_url))
    kwargs.setdefault("batch_size", 6)
    with AsyncLoader(source, decode=ImageDecoder(16), **kwargs) as loader:
        seen = [identify(image) for images, _ in loader for image in images.numpy()]
    return seen, loader.stats


def test_the_registration_is_undone(s3_server):
    import s3fs

    fsspec.get_filesystem_class("s3")  # what a test before this one may have left
    before = dict(_registry)
    with obstore_for_s3():
        assert issubclass(fsspec.get_filesystem_class("s3"), obstore_fsspec.FsspecStore)
    assert dict(_registry) == before
    assert fsspec.get_filesystem_class("s3") is s3fs.S3FileSystem


def test_an_epoch_through_obstore_equals_the_local_one(jpeg_folder, source, obstore_s3):
    local = epoch(image_folder(str(jpeg_folder)))
    remote = epoch(source, storage_options=obstore_s3)
    assert len(local) == len(remote) == 5
    for (li, ll), (ri, rl) in zip(local, remote):
        assert torch.equal(ll, rl) and torch.equal(li, ri)


def test_a_missing_object_names_its_url_and_is_not_retried(s3_jpeg_bucket, obstore_s3):
    url = f"{s3_jpeg_bucket}/cat/no-such-image.jpg"
    with AsyncLoader([url], batch_size=1, storage_options=obstore_s3) as loader:
        with pytest.raises(SampleError, match="no-such-image.jpg.*read: FileNotFoundError"):
            list(loader)
    assert loader.stats.retries == 0


def test_s3fs_storage_options_fail_at_once_with_the_key_named(s3_jpeg_bucket, s3_options, obstore_s3):
    """obstore names its options differently (``config={"aws_endpoint": ...}``, not
    ``endpoint_url``/``key``/``secret``): said at the first read, not retried."""
    with AsyncLoader([f"{s3_jpeg_bucket}/cat/0.jpg"], batch_size=1, storage_options=s3_options) as loader:
        with pytest.raises(SampleError, match="read: ValueError: Configuration key: '(key|secret|endpoint_url)' is not valid"):
            list(loader)
    assert loader.stats.retries == 0


def test_access_denied_is_a_permission_error_not_retried(s3_server, source):
    denied = (403, "AccessDenied", "Access Denied")
    with FaultProxy(s3_server.port, first_tries(denied, tries=100)) as proxy:
        with AsyncLoader(source, batch_size=4, decode=ImageDecoder(16), shuffle=False,
                         storage_options=obstore_options(proxy.endpoint_url)) as loader:
            with pytest.raises(SampleError, match=r"'s3://asyncload-test/jpegs/cat/0.jpg' failed at read: PermissionError") as caught:
                list(loader)
    assert type(caught.value.cause.__cause__).__name__ == "PermissionDeniedError", "obstore's error stays chained"
    assert loader.stats.retries == 0


@pytest.mark.parametrize("fault", [SLOW_DOWN, RESET], ids=["throttled", "reset"])
def test_transient_faults_are_retried_by_us_and_counted(s3_server, source, fault):
    with FaultProxy(s3_server.port, first_tries(fault, tries=2)) as proxy:
        seen, stats = read_epoch(source, proxy.endpoint_url)
    assert sorted(seen) == ALL
    gets = [count for line, count in proxy.counts.items() if line.startswith("GET ")]
    assert gets == [3] * len(ALL), "each object failed twice, then was read once"
    assert stats.retries == 2 * len(ALL), "obstore retried nothing by itself"
    assert stats.failures == []


def test_a_retry_config_of_the_users_is_kept(s3_server, source):
    with FaultProxy(s3_server.port, first_tries(SLOW_DOWN, tries=2)) as proxy:
        options = {**obstore_options(proxy.endpoint_url),
                   "retry_config": {"max_retries": 2, "backoff": {"init_backoff": timedelta(milliseconds=10)}}}
        seen, stats = read_epoch(source, proxy.endpoint_url, storage_options=options)
    assert sorted(seen) == ALL
    assert stats.retries == 0, "obstore retried, as asked"


def test_our_read_timeout_ends_a_stalled_read(s3_server, source):
    with FaultProxy(s3_server.port, first_tries(STALL)) as proxy:
        started = time.monotonic()
        seen, stats = read_epoch(source, proxy.endpoint_url, read_timeout=0.5)
        elapsed = time.monotonic() - started
    assert sorted(seen) == ALL and stats.retries == len(ALL)
    assert elapsed < 10, "stalls overlap: each costs one timeout, not one per object in turn"


def test_the_timeout_that_ends_a_stalled_read_is_ours(s3_server, source):
    """Ours raises TimeoutError; obstore's own would raise its GenericError."""
    with FaultProxy(s3_server.port, first_tries(STALL, tries=100)) as proxy:
        with AsyncLoader(source, batch_size=4, decode=ImageDecoder(16), read_timeout=0.5, read_retries=0,
                         storage_options=obstore_options(proxy.endpoint_url)) as loader:
            with pytest.raises(SampleError, match="failed at read: TimeoutError"):
                list(loader)


def test_obstores_own_request_timeout_is_above_ours(obstore_s3):
    """obstore ends a request at 30 s by default, before our 60 s would; ours must fire first
    (the user's own setting wins)."""
    loop = asyncio.new_event_loop()
    try:
        for options, expected in [(obstore_s3, timedelta(seconds=61)),
                                  ({**obstore_s3, "client_options": {"allow_http": True, "timeout": "5s"}}, "5s")]:
            reader = Reader(loop, storage_options=options, timeout=60.0, retries=1, io_concurrency=8, stats=LoaderStats())
            fs, _ = reader._filesystem("s3://asyncload-test/jpegs/cat/0.jpg")
            assert isinstance(fs, obstore_fsspec.FsspecStore)
            assert fs._client_options["timeout"] == expected
            loop.run_until_complete(reader.aclose())
    finally:
        loop.close()


def test_reads_through_first_byte_latency_overlap(s3_server, source):
    """24 objects behind 0.2 s of latency each: one after the other would take 4.8 s."""
    with LatencyProxy(s3_server.port, (0.2, 0.2)) as proxy:
        started = time.monotonic()
        seen, _ = read_epoch(source, proxy.endpoint_url, batch_size=24)
        elapsed = time.monotonic() - started
    assert sorted(seen) == ALL
    assert elapsed < 2.0


class KeepAliveProxy:
    """Keeps its clients' connections open between requests, as S3 does (moto closes every
    one); each request goes on to moto over a connection of its own."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="keep-alive-proxy", daemon=True)

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "KeepAliveProxy":
        self._thread.start()
        listen = asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self._server = asyncio.run_coroutine_threadsafe(listen, self._loop).result(timeout=10)
        return self

    def __exit__(self, *exc) -> None:
        async def stop() -> None:
            self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def client_connections(self) -> int:
        """Connections this process holds open to the proxy (the clients' side of them)."""
        return sum(1 for c in psutil.Process().net_connections("tcp")
                   if c.raddr and c.raddr.port == self.port and c.status == psutil.CONN_ESTABLISHED)

    async def _handle(self, reader, writer) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"(?i)\r\ncontent-length:\s*(\d+)", head)
                body = await reader.readexactly(int(length.group(1))) if length else b""
                server_reader, server_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
                server_writer.write(head + body)
                response = await server_reader.read()  # moto closes after its answer
                server_writer.close()
                response_head, _, response_body = response.partition(b"\r\n\r\n")
                response_head = re.sub(rb"(?i)\r\nconnection:[^\r]*", b"", response_head) + b"\r\nConnection: keep-alive"
                writer.write(response_head + b"\r\n\r\n" + response_body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, OSError, asyncio.CancelledError):
            pass
        finally:
            writer.close()


def test_close_leaves_no_connection_open(s3_server, source):
    """obstore keeps connections alive in a pool per bucket; closing the loader closes them."""
    with KeepAliveProxy(s3_server.port) as proxy:
        with AsyncLoader(source, batch_size=2, prefetch=1, decode=ImageDecoder(16),
                         storage_options=obstore_options(proxy.endpoint_url)) as loader:
            seen = []
            for number, (images, _) in enumerate(loader):
                seen += [identify(image) for image in images.numpy()]
                if number == 0:  # reads wait for free buffers: the pool is still open
                    assert proxy.client_connections() > 0
        assert sorted(seen) == ALL
        assert wait_until(lambda: proxy.client_connections() == 0, timeout=5), f"{proxy.client_connections()} left open"


@pytest.fixture(scope="module")
def s3_obstore_shards(s3_options, jpeg_folder, tmp_path_factory) -> tuple[str, str]:
    """The test JPEGs as 5 tar shards, on disk and uploaded to ``s3://asyncload-test/obstore-shards``."""
    import s3fs

    local = tmp_path_factory.mktemp("obstore-shards")
    write_shards(image_folder(str(jpeg_folder)), str(local), samples_per_shard=5)
    fs = s3fs.S3FileSystem(**s3_options, skip_instance_cache=True)
    make_bucket(fs)
    for path in sorted(local.iterdir()):
        fs.pipe_file(f"asyncload-test/obstore-shards/{path.name}", path.read_bytes())
    return str(local), "s3://asyncload-test/obstore-shards"


def test_a_tar_shard_epoch_through_obstore_equals_the_local_one(s3_obstore_shards, obstore_s3):
    local, remote = s3_obstore_shards

    def epoch(url, storage_options=None):
        source = tar_shards(url, storage_options=storage_options)
        with AsyncLoader(source, batch_size=24, shuffle=False, decode=DECODE, storage_options=storage_options) as loader:
            (images, labels), = list(loader)
        return images, labels, loader.stats.as_dict()["read/items"]

    local_images, local_labels, _ = epoch(local)
    images, labels, reads = epoch(remote, obstore_s3)
    assert torch.equal(images, local_images) and torch.equal(labels, local_labels)
    assert reads == 5, "one ranged read per shard"
