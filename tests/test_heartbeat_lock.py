"""The lock a node's processes share, with a heartbeat (``io/heartbeat_lock.py``), as its two users
take it: the shard cache on an event loop (``take_async``) and the member-table learner with none
(``take``). A holder is another open description of the lock file holding its real ``flock`` (as a
peer process would); time is a fake clock that only the waiter's sleeps move, so a waiter gives
up after ``patience`` of that clock whatever the machine's load, and nothing here waits on time."""

from __future__ import annotations

import asyncio
import os

import pytest

from asyncload.cache import files
from asyncload.io import heartbeat_lock
from asyncload.cache.lock import PeerLocks
from asyncload.io.heartbeat_lock import POLL_S, LockWait, held

PATIENCE = 1.0


class Holder:
    """A peer holding the lock: ``beats`` (its heartbeat moves at each of the waiter's polls), or
    stalled; ``dies_after`` polls it lets go (a dead process's flock goes with it)."""

    def __init__(self, path, beats: bool, dies_after: int | None = None) -> None:
        self.path, self.beats, self.dies_after = path, beats, dies_after
        self.fd = files.try_lock(path)
        assert self.fd is not None
        self.beat = 1_000_000_000
        os.utime(path, ns=(self.beat, self.beat))
        self.polls = 0

    def on_poll(self) -> None:
        self.polls += 1
        if self.beats:
            self.beat += 1_000
            os.utime(self.path, ns=(self.beat, self.beat))
        if self.dies_after is not None and self.polls == self.dies_after:
            self.release()

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class FakeTime:
    def __init__(self, holder: Holder | None) -> None:
        self.now, self.holder = 100.0, holder

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        if self.holder is not None:
            self.holder.on_poll()

    async def sleep_async(self, seconds: float) -> None:
        self.sleep(seconds)


async def try_lock(path):
    return files.try_lock(path)


def take(path, time: FakeTime, mode: str) -> tuple[int | None, LockWait]:
    wait = LockWait(path, PATIENCE, clock=time.clock)
    if mode == "sync":
        return wait.take(sleep=time.sleep), wait
    return asyncio.run(wait.take_async(try_lock, sleep=time.sleep_async)), wait


@pytest.fixture
def lock_path(tmp_path):
    return tmp_path / "shard.lock"


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_free_lock_is_taken_at_once_and_beaten(lock_path, mode):
    time = FakeTime(None)
    lock, _ = take(lock_path, time, mode)
    assert lock is not None and time.now == 100.0
    assert files.try_lock(lock_path) is None, "held: another description cannot take it"
    os.close(lock)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_stalled_holder_is_given_up_on_after_patience_at_the_beat_it_stood_at(lock_path, mode):
    holder = Holder(lock_path, beats=False)
    time = FakeTime(holder)
    lock, wait = take(lock_path, time, mode)
    assert lock is None and wait.beat == holder.beat
    assert PATIENCE < time.now - 100.0 <= PATIENCE + 2 * POLL_S
    holder.release()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_holder_that_beats_is_waited_for_past_patience_and_its_lock_taken_when_it_dies(lock_path, mode):
    """A slow holder (its beat moves) is waited for well past ``patience``; when it dies its
    flock goes and the waiter takes the lock at the next poll."""
    polls = int(5 * PATIENCE / POLL_S)
    holder = Holder(lock_path, beats=True, dies_after=polls)
    time = FakeTime(holder)
    lock, _ = take(lock_path, time, mode)
    assert lock is not None and holder.polls == polls and time.now - 100.0 >= 5 * PATIENCE - 1e-9
    os.close(lock)


def test_the_shard_cache_remembers_the_stalled_peer_until_its_beat_moves(lock_path):
    """The cache's user (``PeerLocks``): a read gives up on a stalled peer (real clock, a short
    patience: the peer never beats, so the outcome does not depend on the load), the next read
    of that shard goes to storage at once, and once the peer's beat moves it is waited on again."""
    holder = Holder(lock_path, beats=False)
    shard = type("Shard", (), {"lock": lock_path})()
    locks = PeerLocks(timeout=0.2)
    assert asyncio.run(locks.take("url", shard, try_lock)) is None
    assert locks.still_stalled("url", shard)
    holder.beats = True
    holder.on_poll()  # its beat moved: no longer given up on
    assert not locks.still_stalled("url", shard)
    holder.release()
    lock = asyncio.run(locks.take("url", shard, try_lock))
    assert lock is not None and not locks.still_stalled("url", shard)
    os.close(lock)


def test_the_learner_runs_without_the_lock_of_a_stalled_peer_and_says_so(lock_path):
    """The learner's user (``held``): said once that it waits, once that it gives up, and the
    block runs without the lock; with the lock free it holds it and lets go after."""
    holder = Holder(lock_path, beats=False)
    said = []
    with held(lock_path, 0.2, on_wait=lambda: said.append("wait"), on_stalled=lambda: said.append("stalled")) as got:
        assert got is False
    assert said == ["wait", "stalled"]
    holder.release()
    with held(lock_path, 0.2, on_wait=lambda: said.append("wait")) as got:
        assert got is True and files.try_lock(lock_path) is None
    assert said == ["wait", "stalled"]
    fd = files.try_lock(lock_path)
    assert fd is not None, "let go after the block"
    os.close(fd)


@pytest.mark.parametrize("patience", [0.0, 0.01])
def test_the_learner_beats_no_faster_than_it_polls(lock_path, monkeypatch, patience):
    """A short ``timeout`` (``tar_shards(timeout=0)`` is accepted) must not turn the beat into a
    spin: the learner beat every ``max(patience / 3, POLL_S)`` before the lock was shared."""
    periods = []
    monkeypatch.setattr(heartbeat_lock, "_beat", lambda lock, every, stop: periods.append(every))
    with held(lock_path, patience) as got:
        assert got is True
    assert periods == [POLL_S]
