"""Nothing hangs: a read or a decode that never returns fails its sample (or is skipped) within a
bounded time, too many of them give a clear error, ``close()`` from another thread returns at
once, and a child that dies names the samples it held.

What blocks here blocks on a file the test creates at teardown (``Gate``), so that it works in a
child process too; in this process the stuck threads then end before the no-thread-left check.
What the children run is defined at module level: spawn finds it by name.
"""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from asyncload import AsyncLoader, SampleError, TooManyFailures
from asyncload.batch.buffers import BatchBuffer
from asyncload.batch.layout import Field
from asyncload.io.blocking import BlockingCalls, StuckCalls
from asyncload.pipeline import jobs
from asyncload.pipeline.watchdog import Watchdog
from asyncload.pipeline.threads import LoopThread, wait_ended
from asyncload.pipeline.workers import DecodeWorkers, current_slot
from tests.conftest import asyncload_threads, wait_until
from tests.support.gate import Gate

MODES = [0, 2]
BOUND_S = 60.0  # a loop still running after this long hangs (each case takes a few seconds)


class HangingRead:
    """A synchronous read that hangs for the indices in ``stuck`` (a dead mount, say)."""

    def __init__(self, stuck, gate: Gate) -> None:
        self.stuck = set(stuck)
        self.gate = gate

    def __call__(self, index):
        if index in self.stuck:
            self.gate.wait()
        return index


class HangingDecode:
    """A decode that hangs for the indices in ``stuck``; once let go, it returns -1s (which
    must never show up in a batch)."""

    def __init__(self, stuck, gate: Gate) -> None:
        self.stuck = set(stuck)
        self.gate = gate

    def __call__(self, index):
        if index in self.stuck:
            self.gate.wait(index)
            self.gate.mark_done(index)
            return np.full(2, -1, np.int64)
        return np.full(2, index, np.int64)


class HangingInPlace:
    """A decoder that writes its row itself (``decode_into``, as the library's ``ImageDecoder``),
    hanging for the indices in ``stuck``; once let go, it writes -1s into the row it was given
    (which must never show up in a batch)."""

    field = Field((2,), np.dtype(np.int64))

    def __init__(self, stuck, gate: Gate) -> None:
        self.stuck = set(stuck)
        self.gate = gate

    def __call__(self, index):
        return np.full(2, index, np.int64)

    def decode_into(self, index, out, key=None) -> None:
        if index in self.stuck:
            self.gate.wait(index)
            out[...] = -1
            self.gate.mark_done(index)
            return
        out[...] = index


class CrashingDecode:
    """A decode that kills its own process with ``signum`` on index ``fatal`` (a codec crash)."""

    def __init__(self, fatal: int, signum: int) -> None:
        self.fatal = fatal
        self.signum = signum

    def __call__(self, index):
        if index == self.fatal:
            os.kill(os.getpid(), self.signum)
            time.sleep(10)
        return np.full(2, index if isinstance(index, int) else 0, np.int64)


@pytest.fixture
def gate(tmp_path):
    """The gate the stuck calls wait on; opened at teardown, then their threads must end."""
    opened = Gate(tmp_path / "open")
    yield opened
    Path(opened.path).touch()
    assert wait_until(lambda: not asyncload_threads(), timeout=10)


def run_bounded(function):
    """``function()`` on a thread of its own: (its result or the exception it raised). Fails the
    test, instead of hanging it, if it has not returned within ``BOUND_S``."""
    outcome: list = []

    def target():
        try:
            outcome.append(function())
        except BaseException as error:
            outcome.append(error)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(BOUND_S)
    assert not thread.is_alive(), f"still running after {BOUND_S:g} s: it hangs"
    return outcome[0]


def samples(loader) -> list[int]:
    return [value for batch in loader for value in batch[:, 0].tolist()]


# ----- reads -----


@pytest.mark.parametrize("processes", MODES)
def test_reads_that_hang_fail_their_samples(processes, gate):
    with AsyncLoader(list(range(24)), batch_size=4, shuffle=False, read=HangingRead({6, 13}, gate),
                     decode=np.atleast_1d, num_threads=2, read_timeout=0.5, read_retries=0,
                     processes=processes) as loader:
        error = run_bounded(lambda: samples(loader))
    assert isinstance(error, SampleError) and error.item == 6 and error.stage == "read"
    assert "timed out after read_timeout=0.5 s" in str(error)


@pytest.mark.parametrize("processes", MODES)
def test_reads_that_hang_are_skipped_and_the_rest_delivered_once(processes, gate):
    with AsyncLoader(list(range(24)), batch_size=4, shuffle=False, read=HangingRead({6, 13}, gate),
                     decode=np.atleast_1d, num_threads=2, read_timeout=0.5, read_retries=0, on_error="skip",
                     max_failures=2, processes=processes) as loader:
        got = run_bounded(lambda: samples(loader))
        assert sorted(got) == [i for i in range(24) if i not in (6, 13)]
        assert sorted(failure.item for failure in loader.stats.failures) == [6, 13]


@pytest.mark.parametrize("processes", MODES)
def test_more_stuck_reads_than_threads_can_be_replaced_for_is_a_clear_error(processes, gate):
    """One read thread (io_concurrency=1), so at most 4 lost: the 5th stuck read used to wait in
    the queue for ever; now reads fail at once, saying why, and the epoch stops at the budget."""
    with AsyncLoader(list(range(40)), batch_size=4, shuffle=False, read=HangingRead(range(12), gate),
                     decode=np.atleast_1d, num_threads=2, io_concurrency=processes or 1, read_timeout=0.3,
                     read_retries=0, on_error="skip", max_failures=20, processes=processes) as loader:
        error = run_bounded(lambda: samples(loader))
    assert isinstance(error, TooManyFailures), error
    assert any("calls are stuck past read_timeout and still running" in str(failure) for failure in error.failures)


def test_a_call_queued_behind_stuck_threads_times_out(gate):
    """One thread and room for one lost: A and B hang, so nothing is left to start C. C used to
    wait in the queue for ever; it now fails after QUEUED_LIMIT timeouts, and D fails at once."""
    calls = BlockingCalls(1, "asyncload-test", "read_timeout")
    calls.max_lost = 1

    async def attempt(function):
        try:
            return await calls.call_async(function, timeout=0.2)
        except Exception as error:
            return error

    async def main():
        tasks = [asyncio.create_task(attempt(function)) for function in (gate.wait, gate.wait, lambda: "C")]
        return await asyncio.gather(*tasks), await attempt(lambda: "D")

    (a, b, c), d = run_bounded(lambda: asyncio.run(main()))
    assert "timed out after read_timeout=0.2 s" in str(a) and "timed out after read_timeout=0.2 s" in str(b)
    assert isinstance(c, TimeoutError) and "for a thread free to start it" in str(c)
    assert isinstance(d, StuckCalls) and "2 calls are stuck past read_timeout" in str(d)
    calls.shutdown(0)


def test_a_timeout_the_called_function_raises_itself_is_its_own_error_at_once():
    """An ``ETIMEDOUT`` from a soft network mount is a TimeoutError too: it used to be taken for
    the wait running out, retried in a busy loop for the whole timeout, then reported as ours."""
    calls = BlockingCalls(1, "asyncload-test", "read_timeout")

    tries: list[int] = []

    def nfs_read():
        tries.append(1)
        raise OSError(errno.ETIMEDOUT, "Connection timed out (NFS)")

    async def awaited():
        return await calls.call_async(nfs_read, timeout=30)

    for attempt in (lambda: calls.call(nfs_read, timeout=30), lambda: asyncio.run(awaited())):
        tries.clear()
        error = run_bounded(attempt)
        assert isinstance(error, OSError) and error.errno == errno.ETIMEDOUT, error
        assert "timed out after" not in str(error) and tries == [1], "raised as it is, at once: not retried"
    assert not calls.pool.lost()
    calls.shutdown(5)


# ----- decodes -----


@pytest.mark.parametrize("processes", MODES)
def test_a_decode_that_hangs_fails_its_sample(processes, gate):
    with AsyncLoader(list(range(16)), batch_size=4, shuffle=False, read=False, decode=HangingDecode({6}, gate),
                     num_threads=2, decode_timeout=1.0, processes=processes) as loader:
        error = run_bounded(lambda: samples(loader))
    assert isinstance(error, SampleError) and error.item == 6 and error.stage == "decode"
    assert "did not return within decode_timeout=1 s" in str(error)


def test_a_local_file_whose_read_hangs_fails_its_sample_at_stage_read(gate, tmp_path, monkeypatch):
    """A plain local file is read on the decode thread, with no read thread and so no read
    timeout: on a hard network mount that hangs, it used to hold its row for ever, unseen by the
    watchdog. The read is timed as the decode is now. (This process only: what hangs is the
    file system's read, replaced here, which a child would not see; a child runs the same code.)"""
    paths = []
    for i in range(16):
        path = tmp_path / f"{i}.bin"
        path.write_bytes(np.full(2, i, np.int64).tobytes())
        paths.append(str(path))
    real_read = jobs.read_file

    def hung_mount(path, *args, **kwargs):
        if path == paths[6]:
            gate.wait()
        return real_read(path, *args, **kwargs)

    monkeypatch.setattr(jobs, "read_file", hung_mount)
    with AsyncLoader(paths, batch_size=4, shuffle=False, decode=lambda data: np.frombuffer(data, np.int64).copy(),
                     num_threads=2, decode_timeout=0.3, processes=0) as loader:
        error = run_bounded(lambda: samples(loader))
    assert isinstance(error, SampleError) and error.item == paths[6] and error.stage == "read", error
    assert "did not return within decode_timeout=0.3 s" in str(error)


@pytest.mark.parametrize("processes", MODES)
def test_a_decode_that_hangs_is_skipped_and_never_writes_a_batch_handed_out(processes, gate):
    """The stuck decode returns (-1s) after every batch was handed out and while the user still
    holds them: its result must be dropped, not written into the row its replacement filled."""
    with AsyncLoader(list(range(16)), batch_size=4, shuffle=False, read=False, decode=HangingDecode({1, 6}, gate),
                     num_threads=2, decode_timeout=1.0, on_error="skip", max_failures=2,
                     processes=processes) as loader:
        held = run_bounded(lambda: list(loader))
        expected = [i for i in range(16) if i not in (1, 6)]
        assert sorted(v for batch in held for v in batch[:, 0].tolist()) == expected
        assert sorted(failure.item for failure in loader.stats.failures) == [1, 6]
        Path(gate.path).touch()  # the stuck decodes return now, while the user holds every batch
        assert wait_until(lambda: gate.done(1) and gate.done(6), timeout=60)
        if processes:
            # A child's threads are not visible from here: its worker takes the returned -1s a
            # moment after the marks (a busy machine can only make this check pass without them).
            time.sleep(0.2)
        else:
            assert wait_until(lambda: not asyncload_threads(), timeout=60)
        assert sorted(v for batch in held for v in batch[:, 0].tolist()) == expected


@pytest.mark.parametrize("processes", MODES)
def test_an_in_place_decode_that_hangs_fails_its_sample(processes, gate):
    with AsyncLoader(list(range(16)), batch_size=4, shuffle=False, read=False, decode=HangingInPlace({6}, gate),
                     num_threads=2, decode_timeout=1.0, processes=processes) as loader:
        got: list[int] = []
        error = run_bounded(lambda: got.extend(v for batch in loader for v in batch[:, 0].tolist()))
    assert isinstance(error, SampleError) and error.item == 6 and error.stage == "decode", error
    assert "did not return within decode_timeout=1 s" in str(error)
    assert got == [0, 1, 2, 3]  # the batches before the failing one, in order


@pytest.mark.parametrize("processes", MODES)
def test_an_in_place_decode_that_hangs_is_skipped_and_its_late_write_never_shows(processes, gate):
    """The stuck ``decode_into`` writes -1s into its row once let go, after every batch was
    handed out and while the user holds them all: its buffer was poisoned and the batch moved
    to a fresh one, so no batch the user holds changes."""
    with AsyncLoader(list(range(16)), batch_size=4, shuffle=False, read=False, decode=HangingInPlace({1, 6}, gate),
                     num_threads=2, decode_timeout=1.0, on_error="skip", max_failures=2,
                     processes=processes) as loader:
        held = run_bounded(lambda: list(loader))
        delivered = [v for batch in held for v in batch.reshape(-1).tolist()]
        assert sorted(delivered[::2]) == [i for i in range(16) if i not in (1, 6)] and delivered[::2] == delivered[1::2]
        assert sorted(failure.item for failure in loader.stats.failures) == [1, 6]
        Path(gate.path).touch()  # the stuck decodes write now, while the user holds every batch
        assert wait_until(lambda: gate.done(1) and gate.done(6), timeout=60)  # marked after their write
        if not processes:
            assert wait_until(lambda: not asyncload_threads(), timeout=60)
        assert [v for batch in held for v in batch.reshape(-1).tolist()] == delivered


class SlowInPlace:
    """A decoder that writes its row itself, a few milliseconds a sample (as ``ImageDecoder``)."""

    field = Field((2,), np.dtype(np.int64))

    def __call__(self, index):
        return np.full(2, index, np.int64)

    def decode_into(self, index, out, key=None) -> None:
        time.sleep(0.003)
        out[...] = index


def buffers_made(monkeypatch) -> list:
    """Every batch buffer made in this process from now on (a child's are mapped here too)."""
    made = []
    real_init = BatchBuffer.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(BatchBuffer, "__init__", init)
    return made


@pytest.mark.parametrize("processes", MODES)
def test_epochs_left_early_poison_no_buffer(processes, monkeypatch):
    """A stop used to abandon the in-place decodes in flight at once, each poisoning its buffer
    for good: every early ``break`` cost a buffer. They get a short grace now."""
    made = buffers_made(monkeypatch)
    with AsyncLoader(list(range(512)), batch_size=16, shuffle=False, read=False, decode=SlowInPlace(), num_threads=2,
                     processes=processes) as loader:
        counts = []
        for _ in range(5):
            for number, batch in enumerate(loader):
                if number == 2:
                    break
            del batch
            counts.append(len(made))
            assert not [buffer for buffer in made if buffer.poisoned]
    if not processes:  # a child's stop is confirmed later: the parent's next epoch may map a new segment meanwhile
        assert counts[-1] == counts[0], counts


def test_a_buffer_poisoned_at_a_stop_is_used_again_once_its_decode_returns(gate, monkeypatch):
    """A decode that outlasts the stop's grace is abandoned, its buffer poisoned; once it
    returns, it writes no more: the buffer is safe again (this process's buffers: a child's
    stop does not abandon decodes)."""
    made = buffers_made(monkeypatch)
    with AsyncLoader(list(range(32)), batch_size=4, shuffle=False, read=False, decode=HangingInPlace({5}, gate),
                     num_threads=2, decode_timeout=0.3, processes=0) as loader:

        def first_batch():
            for batch in loader:
                # stop only once the decode of 5 has started (else the stop cancels it unstarted)
                assert wait_until(lambda: gate.waiting(5), timeout=10)
                return batch[:, 0].tolist()

        assert run_bounded(first_batch) == [0, 1, 2, 3]
        assert [buffer for buffer in made if buffer.poisoned]  # the stop abandoned the decode of 5
        Path(gate.path).touch()
        assert wait_until(lambda: not [buffer for buffer in made if buffer.poisoned], timeout=10)


def test_the_watchdog_goes_on_after_a_report_of_a_stuck_decode_raises():
    """A report that raises (an answer sent on a broken pipe) used to end the watchdog: every
    later stuck decode then hung for ever, unseen."""
    workers, loop = DecodeWorkers(1, None), LoopThread()
    let_go, reported = threading.Event(), []

    def report(slot, cause, submit):
        reported.append(cause)
        raise BrokenPipeError("the parent is gone")

    def stuck_job():
        slot = current_slot()
        slot.on_timeout, slot.writes = report, None
        slot.started = time.perf_counter()
        let_go.wait()
        slot.claim()

    Watchdog(loop.loop, workers, 0.2, lambda message: None).start()
    try:
        with pytest.warns(RuntimeWarning, match="the decode watchdog failed to report a stuck decode: BrokenPipe"):
            workers.submit(stuck_job)
            workers.submit(stuck_job)  # on the thread that replaced the first
            assert wait_until(lambda: len(reported) == 2, timeout=10), reported
    finally:
        let_go.set()
        workers.stop()
        loop.loop.call_soon_threadsafe(loop.loop.stop)
        assert not wait_ended([loop.thread, *workers.all_threads()], time.monotonic() + 10)
    assert wait_until(lambda: not asyncload_threads(), timeout=10)


def test_stuck_decodes_give_their_place_in_the_tuners_gate_back(gate, monkeypatch):
    """num_threads="auto": a gate lets ``threads`` of the started threads work. Stuck decodes
    used to keep their places in it, so their replacements waited at the gate for ever."""
    monkeypatch.setattr("asyncload.settings.usable_cores", lambda: 2)
    with AsyncLoader(list(range(24)), batch_size=4, shuffle=False, read=False, decode=HangingDecode({1, 2, 5, 6}, gate),
                     num_threads="auto", decode_timeout=0.5, on_error="skip", max_failures=4) as loader:
        got = run_bounded(lambda: samples(loader))
    assert sorted(got) == [i for i in range(24) if i not in (1, 2, 5, 6)]


@pytest.mark.parametrize("processes", MODES)
def test_more_stuck_decodes_than_threads_can_be_replaced_for_is_a_clear_error(processes, gate):
    """One decode thread per pipeline, so at most 4 lost each: past that the run fails, saying why."""
    with AsyncLoader(list(range(48)), batch_size=4, shuffle=False, read=False, decode=HangingDecode(range(1, 24), gate),
                     num_threads=max(1, processes), decode_timeout=0.3, on_error="skip", max_failures=40,
                     processes=processes) as loader:
        error = run_bounded(lambda: samples(loader))
    assert isinstance(error, RuntimeError) and "decodes are stuck past decode_timeout=0.3 s" in str(error), error


@pytest.mark.parametrize("processes", MODES)
def test_after_too_many_stuck_decodes_the_next_epoch_runs_once_they_return(processes, gate):
    """A child's pipeline lives for all epochs: its lost threads, past the most it replaces,
    used to end without a replacement, so the next epoch waited for ever on no thread."""
    with AsyncLoader(list(range(48)), batch_size=4, shuffle=False, read=False, decode=HangingDecode(range(1, 24), gate),
                     num_threads=max(1, processes), decode_timeout=0.3, on_error="skip", max_failures=40,
                     processes=processes) as loader:
        error = run_bounded(lambda: samples(loader))
        assert isinstance(error, RuntimeError) and "decodes are stuck past decode_timeout" in str(error), error
        Path(gate.path).touch()  # the stuck decodes return now
        got = run_bounded(lambda: samples(loader))
    assert sorted(got) == [-1] * 23 + [0, *range(24, 48)], got


@pytest.mark.parametrize("processes", MODES)
def test_while_too_many_decodes_are_still_stuck_the_next_epoch_fails_too(processes, gate):
    """A child's threads all stuck and none replaced: its next epoch used to wait for ever."""
    with AsyncLoader(list(range(48)), batch_size=4, shuffle=False, read=False, decode=HangingDecode(range(1, 24), gate),
                     num_threads=max(1, processes), decode_timeout=0.3, on_error="skip", max_failures=40,
                     processes=processes) as loader:
        for _ in range(2):
            error = run_bounded(lambda: samples(loader))
            assert isinstance(error, RuntimeError) and "stuck past decode_timeout=0.3 s" in str(error), error


@pytest.mark.parametrize("processes", MODES)
@pytest.mark.parametrize("hanging", [HangingDecode, HangingInPlace], ids=["returning", "in-place"])
def test_close_from_another_thread_during_a_hung_decode_returns_at_once(processes, hanging, gate, monkeypatch):
    """A decode that returns its sample and one that writes its own row (``decode_into``). They
    took a stop's timeout each (20 s): made an hour here, a close that waits for the hung decode
    hangs, and ``run_bounded`` says so, however busy the machine. (With children a close kills
    those that do not stop within ``CLOSE_TIMEOUT_S``: there it ends in any case.)"""
    monkeypatch.setattr("asyncload.pipeline.pipelines.STOP_TIMEOUT_S", 3600.0)
    loader = AsyncLoader(list(range(16)), batch_size=4, shuffle=False, read=False, decode=hanging({5}, gate),
                         num_threads=2, decode_timeout=None, processes=processes)
    outcome: list = []

    def consume():
        try:
            samples(loader)
        except RuntimeError as error:
            outcome.append(error)

    consumer = threading.Thread(target=consume)
    consumer.start()
    assert wait_until(lambda: gate.waiting(5), timeout=60)  # the decode of 5 has started and hangs
    run_bounded(loader.close)
    run_bounded(loader.close)
    consumer.join(timeout=BOUND_S)  # a bound against a hang only
    assert not consumer.is_alive() and len(outcome) == 1 and "ended" in str(outcome[0]), outcome
    assert not gate.done(5), "the decode still hangs: nothing waited for it"


# ----- children that die -----


@pytest.mark.parametrize("signum", [signal.SIGSEGV, signal.SIGKILL])
def test_a_child_that_dies_names_the_samples_it_held(signum):
    with AsyncLoader(list(range(16)), batch_size=4, shuffle=False, read=False, decode=CrashingDecode(9, signum),
                     num_threads=2, processes=2) as loader:
        error = run_bounded(lambda: samples(loader))
    assert isinstance(error, RuntimeError) and f"was killed by {signal.Signals(signum).name}" in str(error), error
    assert "while it held these samples: " in str(error) and " 9" in str(error).split("held these samples:")[1]


def test_a_dead_childs_error_shows_the_items_it_held_redacted_and_short():
    items = [f"https://user:hunter2@host/{i}.jpg?{'x' * 5000}" for i in range(16)]
    with AsyncLoader(items, batch_size=4, shuffle=False, read=False, decode=CrashingDecode(items[9], signal.SIGKILL),
                     num_threads=2, processes=2) as loader:
        error = run_bounded(lambda: samples(loader))
    assert isinstance(error, RuntimeError) and "https://***@host/9.jpg" in str(error), error
    assert "hunter2" not in str(error) and len(str(error)) < 2000


def test_decode_timeout_must_be_positive_or_none():
    with pytest.raises(ValueError, match="decode_timeout must be a positive number or None, got 0"):
        AsyncLoader([1, 2], read=False, decode=np.atleast_1d, decode_timeout=0)


@pytest.mark.parametrize("name, value, allowed", [("max_sample_bytes", -1, " or None"), ("read_retry_seconds", 0, ""),
                                                  ("read_retry_seconds", None, "")])
def test_the_other_budgets_are_checked_at_construction(name, value, allowed):
    with pytest.raises(ValueError, match=f"{name} must be a positive number{allowed}, got {value}"):
        AsyncLoader([1, 2], read=False, decode=np.atleast_1d, **{name: value})
