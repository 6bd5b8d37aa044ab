import asyncio
import os
import random
import re
import threading
import time

import numpy as np
import pytest

from asyncload import AsyncLoader, SampleError
from asyncload.io.retries import backoff
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


class SleepsOn:
    """A synchronous read that sleeps ``seconds`` on ``key`` (past the read timeout), returns
    any other key at once. Module level: a child process finds it by name."""

    def __init__(self, key: int, seconds: float) -> None:
        self.key = key
        self.seconds = seconds

    def __call__(self, key: int) -> int:
        if key == self.key:
            time.sleep(self.seconds)
        return key


class AsyncSleepsOn(SleepsOn):
    """``SleepsOn`` as an async read (cancelled when it times out)."""

    async def __call__(self, key: int) -> int:
        if key == self.key:
            await asyncio.sleep(self.seconds)
        return key


def as_int64(value):
    return np.int64(value)


def loader_for(read, n=6, batch_size=3, **kwargs):
    return AsyncLoader(list(range(n)), batch_size=batch_size, shuffle=False, read=read, decode=as_int64, **kwargs)


def test_transient_errors_are_retried_and_counted():
    store = FlakyStore(failures=2, error=ConnectionResetError("reset by peer"))
    with loader_for(store, read_retries=3) as loader:
        assert [b.tolist() for b in loader] == [[0, 1, 2], [3, 4, 5]]
    assert store.calls == {key: 3 for key in range(6)}, "each object is read until it succeeds, once"
    assert loader.stats.retries == 12


def test_retries_run_out_into_a_sample_error_that_says_how_many_attempts():
    store = FlakyStore(failures=10, error=ConnectionResetError("reset by peer"))
    with loader_for(store, read_retries=2) as loader:
        with pytest.raises(SampleError) as caught:
            list(loader)
    assert str(caught.value) == "sample 0 failed at read: ConnectionResetError: reset by peer (attempt 3 of 3)"
    assert type(caught.value.__cause__) is ConnectionResetError
    assert store.calls[0] == 3


def test_permanent_errors_are_not_retried():
    store = FlakyStore(failures=1, error=PermissionError("access denied"))
    with loader_for(store, read_retries=3) as loader:
        with pytest.raises(SampleError) as caught:
            list(loader)
    assert str(caught.value) == "sample 0 failed at read: PermissionError: access denied", "one attempt: no count"
    assert store.calls[0] == 1 and loader.stats.retries == 0


@pytest.mark.parametrize("error", [KeyError("missing"), AttributeError("no attribute 'x'"), IndexError("out of range"),
                                   RuntimeError("a bug")], ids=lambda error: type(error).__name__)
def test_a_programming_error_in_a_read_fails_at_once(error):
    """Everything not known as transient was retried: a KeyError in a user's read for 60 s, 45
    tries, reported as "storage failed for 60.0 s". Only the system's, the network's and the
    storage clients' errors are retried."""
    store = FlakyStore(failures=10, error=error)
    with loader_for(store) as loader:  # the default budget: 60 s of retries
        with pytest.raises(SampleError) as caught:
            list(loader)
    assert str(caught.value) == f"sample 0 failed at read: {type(error).__name__}: {error}"
    assert store.calls[0] == 1 and loader.stats.retries == 0


def test_the_storage_clients_transient_errors_are_retried():
    import aiohttp
    import obstore.exceptions

    from asyncload.io.blocking import StuckCalls
    from asyncload.io.retries import is_transient

    for error in (obstore.exceptions.GenericError("connection refused"), aiohttp.ServerDisconnectedError(),
                  StuckCalls("stuck"), TimeoutError("timed out"), ConnectionRefusedError()):
        assert is_transient(error), error
    for error in (obstore.exceptions.PermissionDeniedError("denied"), FileNotFoundError("gone"), KeyError("k")):
        assert not is_transient(error), error
    store = FlakyStore(failures=2, error=obstore.exceptions.GenericError("connection refused"))
    with loader_for(store, read_retries=3) as loader:
        assert [b.tolist() for b in loader] == [[0, 1, 2], [3, 4, 5]]
    assert loader.stats.retries == 12


@pytest.mark.parametrize("processes", [0, 2])
@pytest.mark.parametrize("read", [SleepsOn(4, 0.6), AsyncSleepsOn(4, 3600)], ids=["sync", "async"])
def test_a_read_that_times_out_says_after_how_long_and_on_which_attempt(read, processes):
    """It used to say "TimeoutError: " and nothing more (asyncio's timeout has no message)."""
    with loader_for(read, read_timeout=0.2, read_retries=2, processes=processes) as loader:
        with pytest.raises(SampleError) as caught:
            list(loader)
    expected = "sample 4 failed at read: TimeoutError: timed out after read_timeout=0.2 s (attempt 3 of 3)"
    assert str(caught.value) == expected
    assert type(caught.value.__cause__) is TimeoutError and caught.value.item == 4
    assert wait_until(lambda: not asyncload_threads())  # the sync reads' sleeps end


@pytest.mark.parametrize("processes", [0, 2])
def test_a_skipped_read_that_timed_out_is_recorded_with_its_timeout_and_attempts(processes):
    with loader_for(AsyncSleepsOn(4, 3600), read_timeout=0.2, read_retries=1, on_error="skip", max_failures=1,
                    processes=processes) as loader:
        assert [batch.tolist() for batch in loader] == [[0, 1, 2], [3, 5]]
    (failure,) = loader.stats.failures
    assert (failure.item, failure.stage) == (4, "read")
    assert failure.error == "TimeoutError: timed out after read_timeout=0.2 s (attempt 2 of 2)"


def test_a_ranged_read_of_a_shard_that_times_out_names_the_bytes_and_the_attempt(tmp_path, jpeg_folder):
    """Tar shards are read in byte ranges: the error says which range of which shard timed out
    (the sample's key names a member, not what was read). The shard is a FIFO with no writer."""
    from asyncload import ImageDecoder, image_folder, tar_shards, write_shards

    write_shards(image_folder(str(jpeg_folder)), str(tmp_path), samples_per_shard=30)  # one shard
    (shard,) = tmp_path.glob("*.tar")
    shard.unlink()
    os.mkfifo(shard)
    source = tar_shards(str(tmp_path))
    start, end = int(source.sample_begin.min()), int(source.sample_end.max())  # one read: the samples' span
    try:
        with AsyncLoader(source, batch_size=4, shuffle=False, decode=ImageDecoder(16),
                         read_timeout=0.2, read_retries=1) as loader:
            with pytest.raises(SampleError) as caught:
                list(loader)
    finally:  # a writer comes and goes: the stuck open()s return and their threads end
        try:
            os.close(os.open(shard, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
    assert str(caught.value).endswith(f"failed at read: TimeoutError: timed out after read_timeout=0.2 s "
                                      f"(bytes {start}-{end} of {shard}, attempt 2 of 2)"), str(caught.value)
    assert wait_until(lambda: not asyncload_threads())


def test_a_stalled_read_times_out():
    async def stall(key):
        await asyncio.sleep(3600)

    with loader_for(stall, read_timeout=0.2, read_retries=1) as loader:
        with pytest.raises(SampleError, match="failed at read: TimeoutError") as caught:
            list(loader)  # the stall is an hour: waiting it out would meet pytest's timeout
    assert isinstance(caught.value.__cause__, TimeoutError)
    assert str(caught.value).endswith("timed out after read_timeout=0.2 s (attempt 2 of 2)"), "two tries of 0.2 s"


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
        assert sorted(v for b in loader for v in b.tolist()) == list(range(64))
    assert peak == 8, "reads overlap, up to io_concurrency (counted, not timed: a busy machine slows them all)"


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


def test_backoff_is_jittered_and_capped_so_a_server_that_is_back_is_seen_within_two_seconds():
    random.seed(1)
    for _ in range(1000):
        waits = [backoff(attempt) for attempt in range(40)]
        assert all(min(2.0, 0.1 * 2**a) / 2 <= w <= min(2.0, 0.1 * 2**a) for a, w in enumerate(waits))
    assert len({round(backoff(20), 6) for _ in range(20)}) > 1, "jittered"


class FailsFor:
    """A read that fails with a refused connection (at once, as a dead server does) until
    ``seconds`` have passed since its first call, then returns the key."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.first: float | None = None
        self.calls = 0

    def __call__(self, key: int) -> int:
        self.calls += 1
        self.first = self.first or time.monotonic()
        if time.monotonic() - self.first < self.seconds:
            raise ConnectionRefusedError("connection refused")
        return key


def test_by_default_a_read_outlasts_fast_failures_by_time_not_by_count():
    """Six counted retries of a refused connection spanned ~3-6 s of backoff: a short outage
    failed the epoch. The default budget retries fast failures for 60 s, trying at least every
    2 s, and gives up at the budget, not a backoff step later."""
    from asyncload.io.retries import RetryBudget

    random.seed(2)
    budget, failing_for, attempt = RetryBudget(), 0.0, 1
    while (pause := budget.wait(attempt, failing_for)) is not None:
        assert pause <= 2.0
        failing_for += pause
        attempt += 1
    assert 60.0 <= failing_for <= 60.0 + 1e-9 and attempt > 30
    assert RetryBudget(retries=6).wait(7, 0.0) is None and RetryBudget(retries=6).wait(6, 100.0) is not None


def test_a_loader_waits_out_fast_failures_and_says_how_long_in_its_stats():
    """Five refused connections in a row, under the default budget (by time): retried until the
    read succeeds, and the backoff waited in the stats: each wait lies between half its step and
    its step (0.1 s, doubling), whatever the machine's load."""
    store = FlakyStore(failures=5, error=ConnectionRefusedError("connection refused"))
    started = time.monotonic()
    with loader_for(store, n=1, batch_size=1) as loader:
        assert [b.tolist() for b in loader] == [[0]]
    elapsed = time.monotonic() - started
    assert store.calls == {0: 6} and loader.stats.retries == 5
    steps = [0.1 * 2**attempt for attempt in range(5)]
    assert sum(steps) / 2 <= loader.stats.retry_wait_seconds <= sum(steps), "the time it waited is in the stats"
    assert elapsed >= loader.stats.retry_wait_seconds, "and it did wait that long"


@pytest.mark.parametrize("processes", [0, 2])
def test_past_its_time_budget_a_read_fails_saying_for_how_long_and_after_how_many_attempts(processes):
    with loader_for(FailsFor(3600), n=1, batch_size=1, read_retry_seconds=1.5, processes=processes) as loader:
        with pytest.raises(SampleError) as caught:
            list(loader)
    message = str(caught.value)
    failed = re.fullmatch(r"sample 0 failed at read: ConnectionRefusedError: connection refused "
                          r"\(storage failed for (\d+\.\d) s, attempt (\d+) \(read_retry_seconds=1\.5\)\)", message)
    assert failed, message
    # At least the budget, and the 2 retries a time budget always gives (retries.MIN_TIMED_RETRIES):
    # how many more fit in 1.5 s, and how far past it the last try ends, depend on the machine's
    # load (backoff's steps are tested above, without a clock). A busy machine makes fewer tries,
    # never more: the waits of 1.5 s of backoff (at least half of 0.1 s doubling) leave room for 7;
    # the default 60 s gives 30 or more.
    assert float(failed.group(1)) >= 1.5 and 3 <= int(failed.group(2)) <= 10, message
    assert type(caught.value.__cause__) is ConnectionRefusedError


def test_the_count_of_read_retries_still_wins_where_it_is_given():
    store = FailsFor(3600)
    with loader_for(store, n=1, batch_size=1, read_retries=1, read_retry_seconds=60) as loader:
        with pytest.raises(SampleError, match=r"connection refused \(attempt 2 of 2\)$"):
            list(loader)
    assert store.calls == 2, "not read_retry_seconds=60"


def test_reads_stuck_past_their_timeout_do_not_fail_the_reads_queued_behind_them():
    """Four sync reads hang (past the timeout) on a pool of four threads: they fail, and the
    reads queued behind them are neither charged for the wait nor kept from a thread."""
    stuck = {0, 1, 2, 3}
    release = threading.Event()
    returned: set[int] = set()  # the stuck reads that returned

    def read(key):
        if key in stuck:
            release.wait(60)  # set below, once the epoch ended: 60 s is only a bound
            returned.add(key)
        return key

    try:
        with loader_for(read, n=24, read_timeout=0.5, read_retries=0, io_concurrency=4, on_error="skip",
                        max_failures=4) as loader:
            got = sorted(v for batch in loader for v in batch.tolist())
            failed = sorted(failure.item for failure in loader.stats.failures)
        # The stuck reads are held for 60 s unless released: an epoch that waited for them would
        # have seen them return.
        assert not returned, "the end of the epoch does not wait for stuck reads"
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
        consumer.join(60)
        assert not consumer.is_alive(), "the epoch never ended"
        assert sum(result["batches"]) == 5  # every good sample
        (failure,) = loader.stats.failures
        assert (failure.item, failure.stage) == (str(fifo), "read")
        assert failure.error == "TimeoutError: timed out after read_timeout=0.5 s (attempt 1 of 1)", "not retried"
    finally:
        try:  # a writer comes and goes: the stuck open() returns and its thread ends
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:  # no reader waits on it (ENXIO)
            pass
        loader.close()
        consumer.join(5)
    assert wait_until(lambda: not asyncload_threads())


MEMORY_CHECK = r"""
import json, os, resource, sys
from asyncload import AsyncLoader, ImageDecoder
good, sparse, processes = sys.argv[1], sys.argv[2], int(sys.argv[3])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
items = [good, "/dev/zero", good, sparse, good]
with AsyncLoader(items, batch_size=5, shuffle=False, decode=ImageDecoder(16), on_error="skip", max_failures=2,
                 max_sample_bytes=8 << 20, read_timeout=20, processes=processes) as loader:
    sizes = [len(batch) for batch in loader]
    failures = [(f.item, f.error) for f in loader.stats.failures]
print(json.dumps({"sizes": sizes, "failures": failures,
                  "grew_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before,
                  "children_kb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))
"""


@pytest.mark.parametrize("processes", [0, 2])
def test_dev_zero_and_a_sparse_file_larger_than_max_sample_bytes_fail_alone_in_bounded_memory(
        tmp_path, jpeg_folder, processes):
    """``/dev/zero`` as an item grew without bound; a sparse 3 GiB file took 6.4 GB. Each now
    fails alone, naming its size (or that it is over) and the limit; memory barely moves."""
    import json
    import subprocess
    import sys

    sparse = tmp_path / "sparse.jpg"
    with open(sparse, "wb") as file:
        file.truncate(3 << 30)
    good = str(next(iter(sorted(jpeg_folder.rglob("*.jpg")))))
    out = subprocess.run([sys.executable, "-c", MEMORY_CHECK, good, str(sparse), str(processes)],
                         capture_output=True, text=True, timeout=120, cwd=os.getcwd())
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["sizes"] == [3]
    limit = "over max_sample_bytes=8388608 (8.0 MiB); pass AsyncLoader(max_sample_bytes=...) a larger budget to read it"
    assert dict(result["failures"]) == {
        "/dev/zero": f"SampleTooLarge: the object is more than 8388608 bytes, {limit}",
        str(sparse): f"SampleTooLarge: the object is 3221225472 bytes (3072.0 MiB), {limit}",
    }
    assert result["grew_kb"] < 200_000, "no object read whole"
    assert result["children_kb"] < 1_500_000


def test_what_a_read_function_returns_is_held_to_max_sample_bytes():
    with AsyncLoader([0, 1, 2], batch_size=3, shuffle=False, read=lambda key: bytes(key * 1000),
                     decode=lambda data: np.int64(len(data)), max_sample_bytes=1500) as loader:
        with pytest.raises(SampleError) as caught:
            list(loader)
    assert str(caught.value) == ("sample 2 failed at read: SampleTooLarge: what read returned is 2000 bytes (0.0 MiB), "
                                 "over max_sample_bytes=1500 (0.0 MiB); pass AsyncLoader(max_sample_bytes=...) "
                                 "a larger budget to read it")


def test_a_local_file_of_exactly_max_sample_bytes_is_read(tmp_path):
    path = tmp_path / "sample.bin"
    path.write_bytes(b"x" * 4096)
    with AsyncLoader([str(path), f"file://{path}"], batch_size=2, shuffle=False, decode=lambda data: np.int64(len(data)),
                     max_sample_bytes=4096) as loader:
        assert [b.tolist() for b in loader] == [[4096, 4096]]


def test_one_size_limited_local_read_serves_the_decode_threads_and_the_reader(tmp_path):
    """``io/limits.read_file``: the reader's read threads read anything (bounded); a decode
    thread (``regular_only``) reads regular files only, and never blocks on a FIFO."""
    from asyncload.io.limits import SampleTooLarge, read_file

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert read_file(str(fifo), 10, regular_only=True) is None  # no writer: it must not wait for one
    path = tmp_path / "eleven"
    path.write_bytes(b"x" * 11)
    assert read_file(str(path), 11) == read_file(str(path), 11, regular_only=True) == b"x" * 11
    with pytest.raises(SampleTooLarge):
        read_file(str(path), 10, regular_only=True)
    with pytest.raises(SampleTooLarge):
        read_file("/dev/zero", 100)  # endless: refused past the limit
