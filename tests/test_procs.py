"""isolate=True: the pipeline in a spawned child process, batches in shared memory.

Every test here starts a real child (about two seconds of Python and torch imports), so each
one checks several things that share a loader. Functions the child runs are at module level:
spawn finds them by name.
"""

import asyncio
import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types
from collections import deque
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from asyncload import AsyncLoader, ImageDecoder, SampleError, TooManyFailures, image_folder
from asyncload.isolate_child import CHILD_NICENESS, RING_SLACK, new_positions
from asyncload.progress import Positions
from tests.conftest import make_jpeg, wait_until

ROOT = Path(__file__).resolve().parent.parent


# ----- what the child runs -----


def index_sample(i):
    return np.full(3, i, np.int64)


def structured_sample(i):
    return {"pair": (np.full(2, i, np.int64), np.float32(i / 2)), "negative": np.int64(-i)}


def fails_if_a_multiple_of_seven(i):
    if i % 7 == 0:
        raise ValueError(f"item {i} is corrupt")
    return np.full(2, i, np.int64)


def hangs_after_the_first_batch(i):
    if i >= 4:
        time.sleep(60)
    return np.full(2, i, np.int64)


async def stalls_after_the_first_batch(i):
    if i >= 8:
        await asyncio.sleep(60)  # a read that hangs; stopping must not wait for it
    return i


def slow_read(i):
    time.sleep(0.2)
    return i


# ----- helpers -----


def child_pid(loader: AsyncLoader) -> int:
    return loader._isolated.process.pid


def gone(pid: int) -> bool:
    """Exited (an orphan's zombie counts: its reaper is not ours)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def reaped(pid: int) -> bool:
    """Exited and waited for: no zombie left behind."""
    return not psutil.pid_exists(pid)


def mappings(pid: int) -> list[str]:
    """This process's mappings of the child's segments (named asyncload-<child pid>-<id>)."""
    with open("/proc/self/maps") as maps:
        return [line for line in maps if f"memfd:asyncload-{pid}-" in line]


def shm_files() -> set[str]:
    return set(os.listdir("/dev/shm"))


def rows(batches) -> list[int]:
    return [int(row[0]) for batch in batches for row in batch]


# ----- tests -----


def test_batches_equal_the_in_process_loaders_and_stats_come_across(jpeg_folder):
    source = image_folder(str(jpeg_folder))
    kwargs = dict(batch_size=5, seed=3, decode=ImageDecoder(32, train=True))  # random crops and flips
    threads = threading.active_count()
    with AsyncLoader(source, **kwargs) as plain, AsyncLoader(source, isolate=True, **kwargs) as isolated:
        assert len(isolated) == len(plain) == 5
        for epoch in (0, 1):
            plain.set_epoch(epoch)
            isolated.set_epoch(epoch)
            expected = list(plain)  # kept whole: list() must not see a buffer overwritten
            got = list(isolated)
            assert threading.active_count() == threads, "the parent runs no thread of its own"
            assert len(got) == len(expected)
            for (images, labels), (want_images, want_labels) in zip(got, expected):
                assert images.dtype == torch.uint8 and images.shape[1:] == (32, 32, 3)
                assert torch.equal(images, want_images) and torch.equal(labels, want_labels)
        figures = isolated.stats.as_dict()
        assert (figures["batches"], figures["samples"]) == (10, 48)
        assert figures["decode/items"] == 48 and isolated.stats.decode.items == 48
        assert "bottleneck:" in isolated.stats.report()
        assert isolated.tuner is None


def test_tuple_and_dict_samples_keep_their_structure():
    kwargs = dict(batch_size=4, seed=2, read=False, decode=structured_sample)
    with AsyncLoader(list(range(10)), **kwargs) as plain, AsyncLoader(list(range(10)), isolate=True, **kwargs) as isolated:
        expected, got = list(plain), list(isolated)
    assert len(got) == len(expected) == 3
    for batch, want in zip(got, expected):
        assert set(batch) == {"pair", "negative"} and isinstance(batch["pair"], tuple)
        assert batch["pair"][1].dtype == torch.float32
        assert torch.equal(batch["pair"][0], want["pair"][0]) and torch.equal(batch["pair"][1], want["pair"][1])
        assert torch.equal(batch["negative"], want["negative"])


def test_kept_batches_stay_intact_and_released_buffers_are_reused():
    with AsyncLoader(list(range(160)), batch_size=4, seed=1, read=False, decode=index_sample, isolate=True,
                     prefetch=2) as loader:
        kept = list(loader)  # 40 batches held at once: the child must allocate beyond its ring
        assert rows(kept) == loader.sampler.order(0).tolist()
        assert all(bool((batch[:, 0:1] == batch).all()) for batch in kept)
        pid = child_pid(loader)
        assert len(mappings(pid)) >= 40
        del kept
        loader.set_epoch(1)
        before = set(loader._isolated.segments)
        for batch in loader:  # dropped one by one: the ring's buffers come back
            pass
        del batch
        created = set(loader._isolated.segments) - before
        assert not created, "a released buffer is reused, not allocated anew"
        loader.set_epoch(2)
        next(iter(loader))
        assert len(mappings(pid)) <= 2 + RING_SLACK, "segments nobody uses are unmapped"


def test_a_corrupt_file_raises_sample_error_naming_it(tmp_path, jpeg_folder):
    good = str(next(jpeg_folder.rglob("*.jpg")))
    corrupt = tmp_path / "broken.jpg"
    corrupt.write_bytes(make_jpeg((1, 2, 3))[:300])
    items = [good, good, good, str(corrupt), good]
    with AsyncLoader(items, batch_size=2, shuffle=False, decode=ImageDecoder(16), isolate=True) as loader:
        batches = iter(loader)
        assert next(batches).shape == (2, 16, 16, 3)  # the batch before it arrives first
        with pytest.raises(SampleError, match="broken.jpg.*decode") as caught:
            next(batches)
        assert caught.value.item == str(corrupt) and caught.value.stage == "decode"
        assert isinstance(caught.value.__cause__, ValueError)
        assert any("in the isolated loader's process" in note for note in caught.value.__cause__.__notes__)
        assert [f.item for f in loader.stats.failures] == [str(corrupt)]


def test_skip_policy_and_its_failure_budget():
    items = list(range(30))  # 0, 7, 14, 21, 28 fail
    bad = {i for i in items if i % 7 == 0}
    kwargs = dict(batch_size=4, read=False, decode=fails_if_a_multiple_of_seven, on_error="skip", isolate=True)
    with AsyncLoader(items, max_failures=10, **kwargs) as loader:
        batches = list(loader)
        assert sorted(rows(batches)) == sorted(set(items) - bad)
        assert sorted(f.item for f in loader.stats.failures) == sorted(bad)
    with AsyncLoader(items, max_failures=2, shuffle=False, **kwargs) as loader:
        with pytest.raises(TooManyFailures) as caught:
            list(loader)
    assert caught.value.item == [0, 7, 14]
    assert "3 samples failed, more than max_failures=2" in str(caught.value)


def test_resume_via_state_dict_gives_exactly_the_remaining_batches():
    kwargs = dict(batch_size=4, shuffle=True, seed=9, read=False, decode=index_sample)
    with AsyncLoader(list(range(40)), **kwargs) as plain:
        plain.set_epoch(3)
        uninterrupted = [b.tolist() for b in plain]
    with AsyncLoader(list(range(40)), isolate=True, **kwargs) as loader:
        loader.set_epoch(3)
        batches = iter(loader)
        head = [next(batches).tolist() for _ in range(3)]
        state = loader.state_dict()
        del batches
        assert state["delivered"] == [[0, 12]] and state["epoch"] == 3
        loader.set_epoch(0)
        loader.load_state_dict(state)  # as after a restart
        rest = [b.tolist() for b in loader]
    assert head + rest == uninterrupted


def test_break_stops_the_childs_pipeline_and_close_ends_the_child():
    shm_before = shm_files()
    loader = AsyncLoader(list(range(100_000)), batch_size=8, shuffle=False, read=stalls_after_the_first_batch,
                         decode=np.asarray, isolate=True)
    pid = child_pid(loader)
    child = psutil.Process(pid)
    first = iter(loader)
    next(first)
    running = child.num_threads()  # with the event loop, decode and forwarding threads
    lower = min(19, os.getpriority(os.PRIO_PROCESS, 0) + CHILD_NICENESS)
    assert {os.getpriority(os.PRIO_PROCESS, t.id) for t in child.threads()} == {lower}, "every thread yields the CPU"
    for batch in loader:  # a new iteration replaces the unfinished one
        break  # while the child waits for stalled reads
    del batch
    with pytest.raises(RuntimeError, match="iteration has ended"):
        next(first)
    assert wait_until(lambda: child.num_threads() <= running - 3, timeout=3.0), "after break the child's threads end"
    kept = next(iter(loader))  # it starts again for the next iteration, in the same process
    assert child_pid(loader) == pid and kept.tolist() == list(range(8))
    loader.close()
    assert reaped(pid), "close() ends the child"
    assert kept.tolist() == list(range(8)), "a batch kept after close() stays valid"
    assert len(mappings(pid)) == 1
    del kept
    assert not mappings(pid), "no segment stays mapped"
    assert shm_files() == shm_before, "nothing in /dev/shm"
    with pytest.raises(RuntimeError, match="closed"):
        iter(loader)


def test_garbage_collection_ends_the_child():
    loader = AsyncLoader(list(range(100_000)), batch_size=8, read=False, decode=index_sample, isolate=True)
    pid = child_pid(loader)
    batches = iter(loader)
    next(batches)
    del batches, loader
    gc.collect()
    assert reaped(pid)
    assert not mappings(pid)


def test_a_child_that_dies_mid_epoch_raises_runtime_error():
    loader = AsyncLoader(list(range(1000)), batch_size=4, read=False, decode=index_sample, isolate=True, prefetch=1)
    pid = child_pid(loader)
    batches = iter(loader)
    kept = next(batches)
    os.kill(pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"process \(pid {pid}\) was killed by SIGKILL"):
        deque(batches, maxlen=0)  # a batch already sent may still arrive first
    assert time.monotonic() - started < 3.0
    assert kept.tolist() == [[i] * 3 for i in loader.sampler.order(0)[:4]], "what the user holds stays valid"
    with pytest.raises(RuntimeError, match="killed by SIGKILL"):
        list(loader)
    loader.close()
    del kept
    assert not mappings(pid)


def test_the_child_exits_when_the_parent_dies():
    """Even while the child is busy stopping an iteration whose decodes hang."""
    script = textwrap.dedent("""
        import time
        from asyncload import AsyncLoader
        from tests.test_isolate import hangs_after_the_first_batch
        loader = AsyncLoader(list(range(1000)), batch_size=4, shuffle=False, read=False,
                             decode=hangs_after_the_first_batch, isolate=True)
        batches = iter(loader)
        next(batches)
        del batches  # the child now waits for the hanging decodes to stop
        time.sleep(0.5)
        print(loader._isolated.process.pid, flush=True)
        time.sleep(60)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        pid = int(parent.stdout.readline())
        assert not gone(pid)
        parent.kill()
        parent.wait()
        assert wait_until(lambda: gone(pid), timeout=5.0), "the orphaned child must exit"
    finally:
        parent.kill()
        parent.stdout.close()


def test_ctrl_c_and_close_from_another_thread_while_waiting_for_a_batch():
    loader = AsyncLoader(list(range(100)), batch_size=4, read=slow_read, decode=np.asarray, io_concurrency=2,
                         isolate=True)
    pid = child_pid(loader)
    main = threading.main_thread().ident

    def ctrl_c():  # a terminal sends SIGINT to the whole process group
        os.kill(pid, signal.SIGINT)
        signal.pthread_kill(main, signal.SIGINT)

    assert next(iter(loader)).shape == (4,)  # the child is up
    timer = threading.Timer(0.1, ctrl_c)
    timer.start()
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        for _ in loader:
            pass
    timer.join()
    assert time.monotonic() - started < 2.0
    assert next(iter(loader)).shape == (4,), "the child leaves Ctrl-C to the parent and goes on"
    assert child_pid(loader) == pid
    closer = threading.Timer(0.1, loader.close)  # close() from another thread, during a wait
    closer.start()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="iteration has ended"):
        deque(iter(loader), maxlen=0)
    closer.join()
    assert time.monotonic() - started < 3.0
    assert reaped(pid)


def test_normalize_and_progress_on_the_parent_side(jpeg_folder):
    source = image_folder(str(jpeg_folder))
    norm = ((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    with AsyncLoader(source, batch_size=4, shuffle=False, decode=ImageDecoder(16)) as plain, \
         AsyncLoader(source, batch_size=4, shuffle=False, decode=ImageDecoder(16), normalize=norm, progress=True,
                     isolate=True) as normed:
        raw, _ = next(iter(plain))
        floats, labels = next(iter(normed))
    assert floats.shape == (4, 3, 16, 16) and floats.dtype == torch.float32
    torch.testing.assert_close(floats, (raw.permute(0, 3, 1, 2).float() / 255 - 0.5) / 0.25)


def test_arguments_that_do_not_pickle_are_named_at_construction():
    def local_decode(i):
        return i

    started = len(psutil.Process().children())
    for decode in (lambda i: i, local_decode):
        with pytest.raises(TypeError, match=r"decode= must pickle.*top level of a module"):
            AsyncLoader(list(range(4)), read=False, decode=decode, isolate=True)
    with pytest.raises(TypeError, match="source= must pickle"):
        AsyncLoader([threading.Lock()], read=False, decode=index_sample, isolate=True)
    assert len(psutil.Process().children()) == started, "no child is started"


def test_a_function_the_child_cannot_find_is_reported_at_the_first_batch():
    module = types.ModuleType("only_in_this_process")  # as a function in a notebook's __main__
    exec("import numpy as np\ndef decode(i):\n    return np.int64(i)\n", module.__dict__)
    sys.modules[module.__name__] = module
    try:
        with AsyncLoader(list(range(4)), read=False, decode=module.decode, isolate=True) as loader:
            pid = child_pid(loader)
            assert wait_until(loader._isolated.conn.poll, timeout=20)  # the child has failed: it must still say why
            time.sleep(0.2)
            with pytest.raises(RuntimeError, match="could not build its pipeline") as caught:
                list(loader)
            assert "could not unpickle decode=" in str(caught.value.__cause__)
            with pytest.raises(RuntimeError, match="could not build its pipeline"):
                list(loader)
        assert reaped(pid)
    finally:
        del sys.modules[module.__name__]


@given(st.lists(st.integers(0, 60), max_size=30), st.lists(st.integers(0, 60), max_size=30))
def test_new_positions_are_the_difference_of_delivered_intervals(before, extra):
    delivered = Positions()
    delivered.add(before)
    after = Positions(delivered.intervals())
    after.add(extra)
    new = new_positions(delivered.intervals(), after.intervals())
    assert [p for start, stop in new for p in range(start, stop)] == sorted(set(extra) - set(before))
