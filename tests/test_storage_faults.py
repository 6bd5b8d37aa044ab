"""Failing storage, through a misbehaving proxy in front of a real S3 server (moto) on 127.0.0.1,
with each client: obstore (the default) and s3fs (``client="fsspec"``). The errors, retries and
timeouts users see are asyncload's, whichever client reads."""

import threading
import time

import pytest

from asyncload import AsyncLoader, ImageDecoder, SampleError, image_folder
from bench.s3server import storage_options
from tests.conftest import CLASSES, PER_CLASS, identify
from tests.faults import INTERNAL, RESET, SLOW_DOWN, STALL, FaultProxy, first_tries

ALL = sorted((label, index) for label in range(len(CLASSES)) for index in range(PER_CLASS))


@pytest.fixture(params=["obstore", "fsspec"])
def client(request) -> str:
    if request.param == "obstore":
        pytest.importorskip("obstore", reason="obstore has wheels for Python 3.11+ only")
    return request.param


@pytest.fixture
def source(moto_server, moto_jpeg_bucket):
    return image_folder(moto_jpeg_bucket, storage_options=storage_options(moto_server.endpoint_url))


def options(proxy, client: str) -> dict:
    """fsspec-style options through ``proxy``, read by ``client``."""
    return {**storage_options(proxy.endpoint_url), "client": client}


def read_epoch(source, proxy, client, **kwargs):
    """Every (label, index) delivered in one epoch through ``proxy``, and the loader's stats."""
    kwargs.setdefault("batch_size", 6)
    with AsyncLoader(source, decode=ImageDecoder(16), storage_options=options(proxy, client), **kwargs) as loader:
        seen = [identify(image) for images, _ in loader for image in images.numpy()]
    return seen, loader.stats


@pytest.mark.parametrize("fault", [SLOW_DOWN, INTERNAL, RESET], ids=["throttled", "500", "reset"])
def test_transient_faults_are_retried_and_counted(moto_server, source, fault, client):
    with FaultProxy(moto_server.port, first_tries(fault, tries=2)) as proxy:
        seen, stats = read_epoch(source, proxy, client)
    assert sorted(seen) == ALL
    gets = [count for line, count in proxy.counts.items() if line.startswith("GET ")]
    assert gets == [3] * len(ALL), "each object failed twice, then was read once"
    if fault == RESET and client == "fsspec":  # aiohttp retries a reset connection once by itself
        assert stats.retries >= len(ALL)
    else:
        assert stats.retries == 2 * len(ALL)
    assert stats.failures == []


def test_a_stalled_read_times_out_and_is_retried(moto_server, source, client):
    with FaultProxy(moto_server.port, first_tries(STALL)) as proxy:
        started = time.monotonic()
        # 1 s: 24 retries that go out together must all be served within it, by a single-
        # threaded server on a loaded 2-core machine (0.5 s sometimes timed out a retry too).
        seen, stats = read_epoch(source, proxy, client, read_timeout=1.0)
        elapsed = time.monotonic() - started
    assert sorted(seen) == ALL and stats.retries == len(ALL)
    assert elapsed < 10, "stalls overlap: each costs one timeout, not one per object in turn"


def test_a_server_restart_mid_epoch_loses_nothing(moto_server, source, client):
    with FaultProxy(moto_server.port) as proxy:
        restart = threading.Timer(1.0, proxy.start_listening)
        with AsyncLoader(source, batch_size=4, decode=ImageDecoder(16), prefetch=1, io_concurrency=4,
                         storage_options=options(proxy, client)) as loader:
            seen = []
            for number, (images, _) in enumerate(loader):
                seen += [identify(image) for image in images.numpy()]
                if number == 1:
                    # Down before this loop takes the next batch, so the reads of the batch
                    # after it (prefetch=1) cannot have gone out yet: they must meet a dead server.
                    proxy.stop_listening()
                    restart.start()
        restart.join()
    assert sorted(seen) == ALL
    assert loader.stats.retries > 0 and loader.stats.failures == []


def test_a_server_that_stays_down_gives_a_clear_error_in_bounded_time(moto_server, source, client):
    with FaultProxy(moto_server.port) as proxy:
        proxy.stop_listening()
        started = time.monotonic()
        with AsyncLoader(source, batch_size=4, decode=ImageDecoder(16), read_retries=3,
                         storage_options=options(proxy, client)) as loader:
            with pytest.raises(SampleError, match=r"s3://asyncload-test/jpegs/\w+/\d\.jpg' failed at read") as caught:
                list(loader)
        elapsed = time.monotonic() - started
        proxy.start_listening()  # so that leaving the proxy's context is orderly
    assert elapsed < 5.0, "3 retries back off by at most 0.1 + 0.2 + 0.4 s"
    assert ("error sending request" if client == "obstore" else "Could not connect") in str(caught.value)
    assert loader.stats.retries >= 3


def test_access_denied_is_not_retried_and_names_the_object(moto_server, source, client):
    denied = (403, "AccessDenied", "Access Denied")
    with FaultProxy(moto_server.port, first_tries(denied, tries=100)) as proxy:
        with AsyncLoader(source, batch_size=4, decode=ImageDecoder(16), shuffle=False,
                         storage_options=options(proxy, client)) as loader:
            with pytest.raises(SampleError, match=r"'s3://asyncload-test/jpegs/cat/0.jpg' failed at read: PermissionError"):
                list(loader)
    assert loader.stats.retries == 0


def test_close_from_another_thread_during_a_stalled_read(moto_server, source, client):
    from tests.conftest import asyncload_threads

    with FaultProxy(moto_server.port, first_tries(STALL, tries=100)) as proxy:
        loader = AsyncLoader(source, batch_size=4, decode=ImageDecoder(16), storage_options=options(proxy, client))
        outcome = []

        def consume():
            try:
                list(loader)
            except RuntimeError as error:
                outcome.append(error)

        consumer = threading.Thread(target=consume)
        consumer.start()
        time.sleep(0.5)  # reads are out and stalled
        started = time.monotonic()
        loader.close()
        consumer.join(timeout=5)
        assert time.monotonic() - started < 1.0
        assert not asyncload_threads() and not consumer.is_alive()
    assert "loader was closed" in str(outcome[0])
