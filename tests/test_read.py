import asyncio
import os
import random
import threading
import time

import numpy as np
import pytest

from asyncload import AsyncLoader, SampleError
from asyncload.io.reader import backoff
from tests.conftest import asyncload_threads, wait_until


class FlakyStore:
    """A read function whose first ``failures`` calls per key fail with ``error``."""

    def __init__(self, failures: int, error: Exception) -> None:
        self.failures = failures
        self.error = error
        self.calls: dict[int, int] = {}
        self.lock = threading.Lock()

    def __call__(self, key: int) -> int:
        with self.lock:
            self.calls[key] = self.calls.get(key, 0) + 1
            if self.calls[key] <= self.failures:
                raise self.error
        return key


def loader_for(read, n=6, **kwargs):
    return AsyncLoader(list(range(n)), batch_size=3, shuffle=False, read=read, decode=lambda v: np.int64(v), **kwargs)


def test_transient_errors_are_retried_and_counted():
    store = FlakyStore(failures=2, error=ConnectionResetError("reset by peer"))
    with loader_for(store, read_retries=3) as loader:
        assert [b.tolist() for b in loader] == [[0, 1, 2], [3, 4, 5]]
    assert store.calls == {key: 3 for key in range(6)}, "each object is read until it succeeds, once"
    assert loader.stats.retries == 12


def test_retries_run_out_into_a_sample_error():
    store = FlakyStore(failures=10, error=ConnectionResetError("reset by peer"))
    with loader_for(store, read_retries=2) as loader:
        with pytest.raises(SampleError, match="sample 0 failed at read: ConnectionResetError: reset by peer"):
            list(loader)
    assert store.calls[0] == 3


def test_permanent_errors_are_not_retried():
    store = FlakyStore(failures=1, error=PermissionError("access denied"))
    with loader_for(store, read_retries=3) as loader:
        with pytest.raises(SampleError, match="PermissionError: access denied"):
            list(loader)
    assert store.calls[0] == 1 and loader.stats.retries == 0


def test_a_stalled_read_times_out():
    async def stall(key):
        await asyncio.sleep(3600)

    started = time.monotonic()
    with loader_for(stall, read_timeout=0.2, read_retries=1) as loader:
        with pytest.raises(SampleError, match="failed at read: TimeoutError") as caught:
            list(loader)
    assert isinstance(caught.value.__cause__, TimeoutError)
    assert time.monotonic() - started < 3.0


def test_reads_overlap_up_to_io_concurrency():
    in_flight, peak = 0, 0

    async def slow(key):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.05)
        in_flight -= 1
        return key

    with AsyncLoader(list(range(64)), batch_size=16, read=slow, decode=lambda v: np.int64(v), io_concurrency=8, prefetch=4) as loader:
        started = time.monotonic()
        assert sorted(v for b in loader for v in b.tolist()) == list(range(64))
        elapsed = time.monotonic() - started
    assert peak == 8
    assert elapsed < 64 * 0.05 / 2, "reads must overlap"


def test_stats_count_bytes_read(jpeg_folder):
    from asyncload import ImageDecoder, image_folder

    source = image_folder(str(jpeg_folder))
    total = sum(p.stat().st_size for p in jpeg_folder.rglob("*.jpg"))
    with AsyncLoader(source, batch_size=8, decode=ImageDecoder(16)) as loader:
        list(loader)
    assert loader.stats.read.items == len(source) and loader.stats.read.bytes == total
    assert loader.stats.decode.items == len(source)
    assert loader.stats.batches == 3 and loader.stats.samples == len(source)
    assert "read" in loader.stats.report() and "decode" in loader.stats.report()


def test_the_default_retries_wait_long_enough_to_outlast_a_short_restart():
    """Equal jitter: each wait is at least half its exponential step, so 6 retries always wait
    over 3 s in all (full jitter sometimes waited under 1 s and failed across a restart)."""
    random.seed(1)
    for _ in range(1000):
        waits = [backoff(attempt) for attempt in range(6)]
        assert 3.15 <= sum(waits) <= 6.3
        assert all(0.1 * 2**a / 2 <= w <= 0.1 * 2**a for a, w in enumerate(waits))


def test_reads_stuck_past_their_timeout_do_not_fail_the_reads_queued_behind_them():
    """Four sync reads hang (past the timeout) on a pool of four threads: they fail, and the
    reads queued behind them are neither charged for the wait nor kept from a thread."""
    stuck = {0, 1, 2, 3}
    release = threading.Event()

    def read(key):
        if key in stuck:
            release.wait(5)
        return key

    started = time.monotonic()
    try:
        with loader_for(read, n=24, read_timeout=0.5, read_retries=0, io_concurrency=4, on_error="skip",
                        max_failures=4) as loader:
            got = sorted(v for batch in loader for v in batch.tolist())
            failed = sorted(failure.item for failure in loader.stats.failures)
        assert time.monotonic() - started < 4, "the end of the epoch does not wait for stuck reads"
    finally:
        release.set()  # the stuck threads end, as they would when storage answers
    assert wait_until(lambda: not asyncload_threads())
    assert failed == sorted(stuck), "only the stuck reads fail"
    assert got == sorted(set(range(24)) - stuck)


def test_a_local_read_that_hangs_times_out(tmp_path, jpeg_folder):
    """A local path that never answers (a FIFO with no writer, as a hung network mount) fails
    its sample after read_timeout instead of holding a decode thread for ever."""
    from asyncload import ImageDecoder

    good = sorted(str(p) for p in jpeg_folder.rglob("*.jpg"))[:5]
    fifo = tmp_path / "hangs.jpg"
    os.mkfifo(fifo)
    loader = AsyncLoader([*good[:2], str(fifo), *good[2:]], batch_size=3, shuffle=False, decode=ImageDecoder(16),
                         read_timeout=0.5, read_retries=0, on_error="skip", max_failures=1)
    result = {}
    consumer = threading.Thread(target=lambda: result.update(batches=[len(b) for b in loader]), daemon=True)
    try:
        consumer.start()
        consumer.join(5)
        assert not consumer.is_alive(), "the epoch never ended"
        assert sum(result["batches"]) == 5  # every good sample
        (failure,) = loader.stats.failures
        assert (failure.item, failure.stage) == (str(fifo), "read") and failure.error.startswith("TimeoutError")
    finally:
        try:  # a writer comes and goes: the stuck open() returns and its thread ends
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:  # no reader waits on it (ENXIO)
            pass
        loader.close()
        consumer.join(5)
    assert wait_until(lambda: not asyncload_threads())
