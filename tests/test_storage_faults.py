"""Failing storage, through a misbehaving proxy in front of a real S3 server (moto) on 127.0.0.1,
with each client: obstore (the default) and s3fs (``client="fsspec"``). The errors, retries and
timeouts users see are asyncload's, whichever client reads."""

import re
import threading
import time

import pytest

from asyncload import AsyncLoader, ImageDecoder, SampleError, image_folder
from tests.support.s3server import storage_options
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
    """Each object's first GET is held unanswered until its client gives up: each times out, is
    retried, and arrives once. What a busy machine changes is left out: a retry it slows past the
    timeout is retried again, and one whose timeout ran out before its request was sent never
    reaches the server (seen with s3fs under two busy loops: 25 retries, 24 GETs again), so the
    retries are at least the stalls and the GETs the server saw again, not an exact count."""
    with FaultProxy(moto_server.port, first_tries(STALL)) as proxy:
        seen, stats = read_epoch(source, proxy, client, read_timeout=1.0)
    assert sorted(seen) == ALL and stats.failures == []
    gets = [count for line, count in proxy.counts.items() if line.startswith("GET ")]
    assert len(gets) == len(ALL) and min(gets) >= 2 and proxy.stalls == len(ALL), "each first GET stalled"
    assert stats.retries >= sum(gets) - len(ALL) >= len(ALL), (stats.retries, gets)
    assert proxy.peak_stalling > 1, "stalls overlap: each costs one timeout, not one per object in turn"


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
        with AsyncLoader(source, batch_size=4, decode=ImageDecoder(16), read_retries=3,
                         storage_options=options(proxy, client)) as loader:
            with pytest.raises(SampleError, match=r"s3://asyncload-test/jpegs/\w+/\d\.jpg' failed at read") as caught:
                list(loader)
        proxy.start_listening()  # so that leaving the proxy's context is orderly
    # The count asked for, not a time budget (60 s): the attempts are in the message.
    assert str(caught.value).endswith("(attempt 4 of 4)"), str(caught.value)
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
        # An hour's read_timeout: a close that waited for the stalled reads would hang (pytest's
        # timeout ends it), whatever the machine's load.
        loader = AsyncLoader(source, batch_size=4, decode=ImageDecoder(16), storage_options=options(proxy, client),
                             read_timeout=3600)
        outcome = []

        def consume():
            try:
                list(loader)
            except RuntimeError as error:
                outcome.append(error)

        consumer = threading.Thread(target=consume)
        consumer.start()
        assert proxy.stalled.wait(timeout=60), "reads are out and stalled"
        loader.close()
        consumer.join(timeout=120)  # a bound against a hang only
        assert not asyncload_threads() and not consumer.is_alive()
    assert "loader was closed" in str(outcome[0])


# ----- a real storage restart (SeaweedFS SIGKILLed, back on the same ports and data) -----

@pytest.fixture(scope="module")
def restartable(jpeg_folder, tmp_path_factory):
    """A SeaweedFS of this module's own (the session's is not restarted under other tests),
    holding the JPEG folder as objects and as tar shards of 4 samples."""
    from asyncload import write_shards
    from tests.support.s3server import SeaweedFS
    from tests.conftest import upload_jpegs

    server = SeaweedFS()
    server.start(timeout=60)
    try:
        options = storage_options(server.endpoint_url)
        upload_jpegs(options, jpeg_folder)
        write_shards(image_folder(str(jpeg_folder)), "s3://asyncload-test/shards", samples_per_shard=4,
                     storage_options=options)
        yield server
    finally:
        server.stop()


def restart_configs(server, cache_dir):
    """(name, source, loader options): single objects and tar shards, in this process and in 2
    children, and shards through the disk cache; every retry setting left at its default."""
    from asyncload import tar_shards

    options = storage_options(server.endpoint_url)
    objects = image_folder("s3://asyncload-test/jpegs", storage_options=options)
    common = {"batch_size": 4, "prefetch": 1, "decode": ImageDecoder(16), "storage_options": options}
    shard_options = {"shuffle_buffer": 1}  # batch k reads shard k alone: later shards wait for the outage
    shards = tar_shards("s3://asyncload-test/shards", options, **shard_options)
    cached = tar_shards("s3://asyncload-test/shards", options, cache_dir=str(cache_dir), **shard_options)
    return [
        ("objects", objects, {**common, "io_concurrency": 4}),
        ("objects, 2 processes", objects, {**common, "io_concurrency": 4, "processes": 2}),
        ("shards", shards, {**common, "io_concurrency": 1, "shuffle": False}),
        ("shards, 2 processes", shards, {**common, "io_concurrency": 2, "shuffle": False, "processes": 2}),
        ("shards, cache_dir", cached, {**common, "io_concurrency": 1, "shuffle": False}),
    ]


def test_a_storage_restart_mid_epoch_loses_and_repeats_nothing(restartable, tmp_path):
    """SeaweedFS killed after each loader's first batch and serving again ~8 s later (5 s down,
    ~3 s to start): with the default retry settings every sample arrives exactly once. (With
    the old count of 6 retries every run failed ~5 s into the outage.) The loaders run at once,
    so one outage serves them all."""
    configs = restart_configs(restartable, tmp_path / "cache")
    first_batch = threading.Barrier(len(configs) + 1)
    down = threading.Event()
    results: dict[str, object] = {}

    def consume(name, source, options):
        seen = []
        try:
            with AsyncLoader(source, **options) as loader:
                for number, (images, labels) in enumerate(loader):
                    found = [identify(image) for image in images.numpy()]
                    assert [label for label, _ in found] == labels.tolist()
                    seen += found
                    if number == 0:
                        first_batch.wait(timeout=60)
                        down.wait(timeout=60)  # the next batches' reads meet a dead server
            results[name] = (seen, loader.stats.retries, loader.stats.retry_wait_seconds, loader.stats.failures)
        except BaseException as error:  # noqa: BLE001: reported below
            results[name] = error
            first_batch.abort()

    threads = [threading.Thread(target=consume, args=config) for config in configs]
    for thread in threads:
        thread.start()
    try:
        first_batch.wait(timeout=60)
    finally:
        restartable.kill()
        down.set()
    time.sleep(5)
    restartable.restart()
    for thread in threads:
        thread.join(timeout=90)
    for name, _, _ in configs:
        result = results.get(name)
        assert not isinstance(result, BaseException), f"{name}: {result!r}"
        seen, retries, waited, failures = result
        assert sorted(seen) == ALL, f"{name}: every sample once"
        assert retries > 0 and waited > 1.0 and failures == [], name


@pytest.mark.parametrize("processes", [0, 2])
def test_storage_down_past_the_retry_budget_fails_once_naming_the_url_the_outage_and_the_attempts(processes):
    """Nothing listens on the port (a server that stays down). A small budget set here: one
    clear error within the budget and a little, not a minute."""
    from tests.support.s3server import free_port

    options = storage_options(f"http://127.0.0.1:{free_port()}")
    url = "s3://asyncload-test/jpegs/cat/0.jpg"
    with AsyncLoader([url], batch_size=1, decode=ImageDecoder(16), storage_options=options, read_retry_seconds=2,
                     processes=processes) as loader:
        with pytest.raises(SampleError) as caught:
            list(loader)
    message = str(caught.value)
    assert message.startswith(f"sample '{url}' failed at read: "), message
    failed = re.search(r"\(storage failed for (\d+\.\d) s, attempt (\d+) \(read_retry_seconds=2\)\)$", message)
    assert failed, message
    # At least the budget and the 2 retries a time budget always gives (retries.MIN_TIMED_RETRIES);
    # how many more fit in 2 s depends on the machine's load (a busy one makes each try slower), as
    # does how far past 2 s the last one ends. A busy machine makes fewer tries, never more: 2 s of
    # backoff (each wait at least half of 0.1 s doubling, capped at 2 s) leave room for 8; the
    # default 60 s gives 30 or more.
    assert float(failed.group(1)) >= 2.0 and 3 <= int(failed.group(2)) <= 10, message
