"""processes=N (and isolate=True, its N=1): the pipeline in child processes (forked by the fork
server where there is one, else spawned), batches in shared memory.

Every loader here starts real children (the fork server's start imports torch once: seconds), so
each test checks several things that share a loader. Functions the children run are at module
level: a child finds them by name.
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

from asyncload import AsyncLoader, ImageDecoder, SampleError, TooManyFailures, image_folder, tar_shards, write_shards
from asyncload.procs.child import CHILD_NICENESS
from asyncload.procs.choice import process_count
from asyncload.procs.start import CHILD_MODULE, start_method
from tests.conftest import epoch, make_jpeg, wait_until

ROOT = Path(__file__).resolve().parent.parent


# ----- what the children run -----


def index_sample(i):
    return np.full(3, i, np.int64)


def environment_mark(i):
    return np.array([int(os.environ.get("ASYNCLOAD_TEST_MARK", "-1")), i], np.int64)


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


def slow_after_the_first_batch(i):
    time.sleep(0.1 if i < 8 else 3)
    return i


def pid_sample(i):
    return np.array([i, os.getpid()], np.int64)


# ----- helpers -----


def child_pids(loader: AsyncLoader) -> list[int]:
    return [process.pid for process in loader._backend.pipelines.processes]


def gone(pid: int) -> bool:
    """Exited (an orphan's zombie counts: its reaper is not ours)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def reaped(pid: int) -> bool:
    """Exited and waited for: no zombie left behind."""
    return not psutil.pid_exists(pid)


def segment_name(loader: AsyncLoader) -> str:
    return loader._backend.pipelines.ring.name


def mappings(name: str) -> list[str]:
    """This process's mappings of one ring's shared segments (named <name>-<number>)."""
    with open("/proc/self/maps") as maps:
        return [line for line in maps if f"memfd:{name}-" in line]


def shm_files() -> set[str]:
    """What Python's or torch's shared memory would leave in /dev/shm (other users' files,
    which come and go on a shared machine, are not ours to count)."""
    return {name for name in os.listdir("/dev/shm") if name.startswith(("psm_", "torch_", "asyncload"))}


def rows(batches) -> list[int]:
    return [int(row[0]) for batch in batches for row in batch]


# ----- tests -----


def test_two_processes_give_the_in_process_batches_and_merged_stats(jpeg_folder):
    source = image_folder(str(jpeg_folder))
    kwargs = dict(batch_size=5, seed=3, decode=ImageDecoder(32, train=True))  # random crops and flips
    threads = threading.active_count()
    with AsyncLoader(source, **kwargs) as plain, AsyncLoader(source, processes=2, **kwargs) as two:
        assert len(two) == len(plain) == 5 and len(child_pids(two)) == 2
        for epoch in (0, 1):
            plain.set_epoch(epoch)
            two.set_epoch(epoch)
            expected = list(plain)  # kept whole: list() must not see a buffer overwritten
            got = list(two)
            assert threading.active_count() == threads, "the parent runs no thread of its own"
            assert len(got) == len(expected)
            for (images, labels), (want_images, want_labels) in zip(got, expected):
                assert images.dtype == torch.uint8 and images.shape[1:] == (32, 32, 3)
                assert torch.equal(images, want_images) and torch.equal(labels, want_labels)
        figures = two.stats.as_dict()
        assert (figures["batches"], figures["samples"], figures["processes"]) == (10, 48, 2)
        assert figures["decode/items"] == 48 and two.stats.decode.items == 48, "both children's decodes count"
        assert figures["read/items"] == 48
        assert "bottleneck:" in two.stats.report()


def test_batches_are_shared_between_the_children():
    with AsyncLoader(list(range(64)), batch_size=4, shuffle=False, read=False, decode=pid_sample,
                     processes=2) as loader:
        batches = [b.tolist() for b in loader]
        pids = set(child_pids(loader))
    assert [row[0] for batch in batches for row in batch] == list(range(64))
    writers = {row[1] for batch in batches for row in batch}
    assert writers == pids, "both children fill batches"
    assert all(len({row[1] for row in batch}) == 1 for batch in batches), "a batch is one child's"


def test_children_take_the_environment_of_the_process_that_starts_them(monkeypatch):
    """The fork server keeps the environment it started with; children take this process's, as
    spawned ones do (credentials, endpoints set by the script after an earlier loader)."""
    with AsyncLoader(list(range(4)), batch_size=4, read=False, decode=index_sample, processes=1) as first:
        list(first)  # a fork server, where there is one, runs from here on
    monkeypatch.setenv("ASYNCLOAD_TEST_MARK", "7")
    with AsyncLoader(list(range(8)), batch_size=4, shuffle=False, read=False, decode=environment_mark,
                     processes=2) as loader:
        rows = torch.cat(list(loader))
    assert rows.tolist() == [[7, i] for i in range(8)]


@pytest.mark.skipif(start_method() != "forkserver", reason="this platform has no fork server")
def test_children_come_from_the_fork_server_with_the_pipeline_imported():
    with AsyncLoader(list(range(8)), batch_size=4, read=False, decode=index_sample, processes=2) as loader:
        parents = {psutil.Process(pid).ppid() for pid in child_pids(loader)}
        assert len(parents) == 1 and os.getpid() not in parents, "forked by one server, not by this process"
        command = " ".join(psutil.Process(parents.pop()).cmdline())
        assert "multiprocessing.forkserver" in command and repr(CHILD_MODULE) in command, command
        assert len(list(loader)) == 2


def test_tuple_and_dict_samples_keep_their_structure():
    kwargs = dict(batch_size=4, seed=2, read=False, decode=structured_sample)
    with AsyncLoader(list(range(10)), **kwargs) as plain, AsyncLoader(list(range(10)), isolate=True, **kwargs) as one:
        assert len(child_pids(one)) == 1, "isolate=True is processes=1"
        expected, got = list(plain), list(one)
    assert len(got) == len(expected) == 3
    for batch, want in zip(got, expected):
        assert set(batch) == {"pair", "negative"} and isinstance(batch["pair"], tuple)
        assert batch["pair"][1].dtype == torch.float32
        assert torch.equal(batch["pair"][0], want["pair"][0]) and torch.equal(batch["pair"][1], want["pair"][1])
        assert torch.equal(batch["negative"], want["negative"])


def test_kept_batches_stay_intact_and_released_buffers_are_reused():
    with AsyncLoader(list(range(160)), batch_size=4, seed=1, read=False, decode=index_sample, processes=2,
                     prefetch=2) as loader:
        ring = loader._backend.pipelines.ring
        kept = list(loader)  # 40 batches held at once: the ring must allocate beyond its size
        assert rows(kept) == loader.sampler.order(0).tolist()
        assert all(bool((batch[:, 0:1] == batch).all()) for batch in kept)
        assert len(mappings(segment_name(loader))) >= 40
        del kept
        loader.set_epoch(1)
        before = set(ring.segments)
        for batch in loader:  # dropped one by one: the ring's buffers come back
            pass
        del batch
        assert not set(ring.segments) - before, "a released buffer is reused, not allocated anew"
        assert len(ring.segments) <= ring.keep + 1, "segments nobody uses are dropped"
        assert len(mappings(segment_name(loader))) <= ring.keep + 1


def test_a_corrupt_file_raises_sample_error_naming_it(tmp_path, jpeg_folder):
    good = str(next(jpeg_folder.rglob("*.jpg")))
    corrupt = tmp_path / "broken.jpg"
    corrupt.write_bytes(make_jpeg((1, 2, 3))[:300])
    items = [good, good, good, str(corrupt), good]
    with AsyncLoader(items, batch_size=2, shuffle=False, decode=ImageDecoder(16), processes=2) as loader:
        batches = iter(loader)
        assert next(batches).shape == (2, 16, 16, 3)  # the batch before it arrives first
        with pytest.raises(SampleError, match="broken.jpg.*decode") as caught:
            next(batches)
        assert caught.value.item == str(corrupt) and caught.value.stage == "decode"
        assert isinstance(caught.value.__cause__, ValueError)
        assert any("in the loader's process" in note for note in caught.value.__cause__.__notes__)
        assert [f.item for f in loader.stats.failures] == [str(corrupt)]


def test_skip_policy_its_failure_budget_and_the_ddp_quota():
    items = list(range(30))  # 0, 7, 14, 21, 28 fail
    bad = {i for i in items if i % 7 == 0}
    kwargs = dict(batch_size=4, read=False, decode=fails_if_a_multiple_of_seven, on_error="skip", processes=2)
    with AsyncLoader(items, max_failures=10, **kwargs) as loader:
        batches = list(loader)
        assert sorted(rows(batches)) == sorted(set(items) - bad), "each good sample exactly once"
        assert sorted(f.item for f in loader.stats.failures) == sorted(bad)
    with AsyncLoader(items, max_failures=2, shuffle=False, **kwargs) as loader:
        with pytest.raises(TooManyFailures) as caught:
            list(loader)
    failed = caught.value.item  # which replacements a batch got depends on timing, as in-process
    assert len(failed) >= 3 and set(failed) <= bad and failed[:2] == [0, 7]
    assert f"{len(failed)} samples failed, more than max_failures=2" in str(caught.value)
    # Two ranks: each delivers len(loader) full batches whatever fails (DDP must not hang).
    for rank in (0, 1):
        with AsyncLoader(items, rank=rank, world_size=2, max_failures=10, **kwargs) as loader:
            sizes = [len(batch) for batch in loader]
        assert sizes == [4, 4, 4, 3]


def test_resume_via_state_dict_gives_exactly_the_remaining_batches():
    kwargs = dict(batch_size=4, shuffle=True, seed=9, read=False, decode=index_sample)
    with AsyncLoader(list(range(40)), **kwargs) as plain:
        plain.set_epoch(3)
        uninterrupted = [b.tolist() for b in plain]
    with AsyncLoader(list(range(40)), processes=2, **kwargs) as loader:
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


def test_tar_shards_give_the_in_process_batches(jpeg_folder, tmp_path):
    write_shards(image_folder(str(jpeg_folder)), str(tmp_path), samples_per_shard=5)
    source = tar_shards(str(tmp_path))
    kwargs = dict(batch_size=4, seed=5, decode=ImageDecoder(16))
    with AsyncLoader(source, **kwargs) as plain, AsyncLoader(source, processes=2, **kwargs) as two:
        for epoch in (0, 1):
            plain.set_epoch(epoch)
            two.set_epoch(epoch)
            expected, got = list(plain), list(two)
            assert len(got) == len(expected) == 6
            for (images, labels), (want_images, want_labels) in zip(got, expected):
                assert torch.equal(images, want_images) and torch.equal(labels, want_labels)


def test_an_epoch_from_s3_equals_the_local_one(jpeg_folder, s3_jpeg_bucket, s3_options):
    local = epoch(image_folder(str(jpeg_folder)))
    remote = epoch(image_folder(s3_jpeg_bucket, storage_options=s3_options), storage_options=s3_options, processes=2)
    assert len(remote) == len(local) == 5
    for (images, labels), (want_images, want_labels) in zip(remote, local):
        assert torch.equal(images, want_images) and torch.equal(labels, want_labels)


def test_out_of_order_delivers_every_sample_once():
    with AsyncLoader(list(range(50)), batch_size=4, read=False, decode=index_sample, processes=2,
                     in_order=False) as loader:
        assert sorted(rows(loader)) == list(range(50))


def test_break_stops_the_run_and_close_ends_the_children():
    shm_before = shm_files()
    loader = AsyncLoader(list(range(100_000)), batch_size=8, shuffle=False, read=stalls_after_the_first_batch,
                         decode=np.asarray, processes=2)
    pids, name = child_pids(loader), segment_name(loader)
    first = iter(loader)
    assert next(first).tolist() == list(range(8))
    lower = max(os.getpriority(os.PRIO_PROCESS, 0), CHILD_NICENESS)
    for pid in pids:
        threads = psutil.Process(pid).threads()
        assert {os.getpriority(os.PRIO_PROCESS, t.id) for t in threads} == {lower}, "every thread yields the CPU"
    for batch in loader:  # a new iteration replaces the unfinished one, while reads stall
        break
    del batch
    with pytest.raises(RuntimeError, match="iteration has ended"):
        next(first)
    ring = loader._backend.pipelines.ring
    kept = next(iter(loader))  # it starts again, in the same processes, and the stalled reads were cancelled
    assert child_pids(loader) == pids and kept.tolist() == list(range(8))
    loader.close()
    assert all(reaped(pid) for pid in pids), "close() ends the children"
    assert kept.tolist() == list(range(8)), "a batch kept after close() stays valid"
    assert len(mappings(name)) == 1
    del kept
    assert not mappings(name), "no segment stays mapped"
    assert not ring.segments
    assert shm_files() == shm_before, "nothing in /dev/shm"
    with pytest.raises(RuntimeError, match="closed"):
        iter(loader)


def test_stopped_runs_give_their_segments_back_once_the_children_confirm():
    loader = AsyncLoader(list(range(100_000)), batch_size=8, shuffle=False, read=slow_after_the_first_batch,
                         decode=np.asarray, io_concurrency=64, processes=2, prefetch=2)
    pool = loader._backend.pipelines
    next(iter(loader))  # the run ends with batches 1-4 still being read
    (answers, held), = pool._stopping.values()
    assert len(held) == loader._backend.window and all(b.in_pipeline for b in held), \
        "unfinished batches (a window of them: batch 0 was handed out) stay out of the ring"
    batches = iter(loader)
    assert next(batches).tolist() == list(range(8))  # waiting for it takes in the children's answers
    assert wait_until(lambda: not pool._stopping or next(batches) is None, timeout=10)
    current = [batch.buffer for batch in loader._passes.driver.window.batches.values()]
    assert all(not b.in_pipeline or any(b is c for c in current) for b in held), "given back to the ring"
    loader.close()


def test_garbage_collection_ends_the_children():
    loader = AsyncLoader(list(range(100_000)), batch_size=8, read=False, decode=index_sample, processes=2)
    pids, name = child_pids(loader), segment_name(loader)
    batches = iter(loader)
    next(batches)
    assert mappings(name)
    del batches, loader
    gc.collect()
    assert all(reaped(pid) for pid in pids)
    assert not mappings(name)


def test_a_child_that_dies_mid_epoch_raises_runtime_error():
    loader = AsyncLoader(list(range(1000)), batch_size=4, read=False, decode=index_sample, processes=2, prefetch=1)
    pids, name = child_pids(loader), segment_name(loader)
    batches = iter(loader)
    kept = next(batches)
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(RuntimeError, match=rf"process \(pid {pids[1]}\) was killed by SIGKILL"):
        deque(batches, maxlen=0)  # a batch already done may still arrive first; unseen, a hang
    assert kept.tolist() == [[i] * 3 for i in loader.sampler.order(0)[:4]], "what the user holds stays valid"
    with pytest.raises(RuntimeError, match="killed by SIGKILL"):
        list(loader)
    loader.close()
    assert all(reaped(pid) for pid in pids)
    del kept
    assert not mappings(name)


def test_the_children_exit_when_the_parent_dies():
    """Even while a child is busy with decodes that hang."""
    script = textwrap.dedent("""
        import time
        from asyncload import AsyncLoader
        from tests.test_procs import hangs_after_the_first_batch
        if __name__ == "__main__":
            loader = AsyncLoader(list(range(1000)), batch_size=4, shuffle=False, read=False,
                                 decode=hangs_after_the_first_batch, processes=2)
            batches = iter(loader)
            next(batches)
            del batches  # the children now have hanging decodes
            print(*[p.pid for p in loader._backend.pipelines.processes], flush=True)
            time.sleep(60)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        pids = [int(pid) for pid in parent.stdout.readline().split()]
        assert len(pids) == 2 and not any(gone(pid) for pid in pids)
        parent.kill()
        parent.wait()
        assert wait_until(lambda: all(gone(pid) for pid in pids), timeout=5.0), "orphaned children must exit"
    finally:
        parent.kill()
        parent.stdout.close()


class AtTheNextWait:
    """Runs ``action`` once, when the loop (the main thread) next blocks waiting for the children's
    answers (``multiprocessing.connection.wait``): a Ctrl-C or a close() lands during a wait for a
    batch, for certain, instead of at a moment guessed (one that lands while a message is half
    read leaves the pipe unusable, by design: "create a new AsyncLoader")."""

    def __init__(self, monkeypatch) -> None:
        import multiprocessing.connection

        self.action = None
        original = multiprocessing.connection.wait

        def wait(objects, timeout=None):
            if timeout is None and self.action is not None and threading.current_thread() is threading.main_thread():
                action, self.action = self.action, None
                action()
            return original(objects, timeout)

        monkeypatch.setattr(multiprocessing.connection, "wait", wait)


def test_ctrl_c_and_close_from_another_thread_while_waiting_for_a_batch(ctrl_c_raises, monkeypatch):
    """The epoch takes 25 batches of 0.2 s reads, 2 at a time in each child: a Ctrl-C, and a
    close() from another thread, each sent while the loop waits for a batch, end the loop there
    (counted: short of the epoch's 25 batches)."""
    loader = AsyncLoader(list(range(100)), batch_size=4, read=slow_read, decode=np.asarray, io_concurrency=2,
                         processes=2)
    pids = child_pids(loader)
    main = threading.main_thread().ident

    def ctrl_c():  # a terminal sends SIGINT to the whole process group
        for pid in pids:
            os.kill(pid, signal.SIGINT)
        signal.pthread_kill(main, signal.SIGINT)  # raised here, on the main thread, at its wait

    assert next(iter(loader)).shape == (4,)  # the children are up
    at_the_next_wait = AtTheNextWait(monkeypatch)
    at_the_next_wait.action = ctrl_c
    got = []
    with pytest.raises(KeyboardInterrupt):
        for batch in loader:
            got.append(batch)
    assert at_the_next_wait.action is None and len(got) < 25, "the Ctrl-C ended the loop, not the epoch"
    assert next(iter(loader)).shape == (4,), "the children leave Ctrl-C to the parent and go on"
    assert child_pids(loader) == pids
    closer = threading.Thread(target=loader.close)  # close() from another thread, during a wait
    at_the_next_wait.action = closer.start
    got = []
    with pytest.raises(RuntimeError, match="iteration has ended"):
        for batch in loader:
            got.append(batch)
    closer.join()
    assert at_the_next_wait.action is None and len(got) < 25, "the close ended the loop, not the epoch"
    assert all(reaped(pid) for pid in pids)


def test_normalize_and_progress_on_the_parent_side(jpeg_folder):
    source = image_folder(str(jpeg_folder))
    norm = ((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    with AsyncLoader(source, batch_size=4, shuffle=False, decode=ImageDecoder(16)) as plain, \
         AsyncLoader(source, batch_size=4, shuffle=False, decode=ImageDecoder(16), normalize=norm, progress=True,
                     num_threads="auto", processes=2) as normed:
        raw, _ = next(iter(plain))
        floats, labels = next(iter(normed))
        assert normed.tuner is not None and normed.tuner.knobs["num_threads"].low == 2
        normed.tuner.knobs["num_threads"].set(3)  # reaches the children as a Limits message
        assert len(list(normed)) == 6
    assert floats.shape == (4, 3, 16, 16) and floats.dtype == torch.float32
    torch.testing.assert_close(floats, (raw.permute(0, 3, 1, 2).float() / 255 - 0.5) / 0.25)


def test_arguments_that_do_not_pickle_are_named_at_construction():
    def local_decode(i):
        return i

    started = len(psutil.Process().children())
    for decode in (lambda i: i, local_decode):
        with pytest.raises(TypeError, match=r"decode= must pickle.*top level of a module"):
            AsyncLoader(list(range(4)), read=False, decode=decode, processes=2)
    with pytest.raises(TypeError, match="source= must pickle"):
        AsyncLoader([threading.Lock()], read=False, decode=index_sample, isolate=True)
    assert len(psutil.Process().children()) == started, "no child is started"


def test_a_function_the_children_cannot_find_is_reported_at_the_first_batch():
    module = types.ModuleType("only_in_this_process")  # as a function in a notebook's __main__
    exec("import numpy as np\ndef decode(i):\n    return np.int64(i)\n", module.__dict__)
    sys.modules[module.__name__] = module
    try:
        with AsyncLoader(list(range(4)), read=False, decode=module.decode, processes=2) as loader:
            pids = child_pids(loader)
            with pytest.raises(RuntimeError, match="could not build its pipeline") as caught:
                list(loader)
            assert "could not unpickle decode=" in str(caught.value.__cause__)
            with pytest.raises(RuntimeError, match="could not build its pipeline"):
                list(loader)
        assert all(reaped(pid) for pid in pids)
    finally:
        del sys.modules[module.__name__]


def test_process_counts():
    assert process_count(None, False) == 0 and process_count(0, False) == 0
    assert process_count(None, True) == 1 and process_count(1, True) == 1
    assert process_count(3, False) == 3
    assert process_count("auto", False) == 0  # the default's old name: starts in this process, may move
    with pytest.raises(ValueError, match="isolate=True is processes=1"):
        process_count(2, True)
    for bad in (-1, "many", 1.5, True):
        with pytest.raises(ValueError, match="processes must be"):
            process_count(bad, False)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_stage_copies_the_next_batch_ahead_from_segments_pinned_only_for_it():
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    kwargs = dict(batch_size=4, seed=4, read=False, decode=index_sample)
    with AsyncLoader(list(range(40)), **kwargs) as plain:
        expected = [b.clone() for b in plain]
    with AsyncLoader(list(range(40)), processes=2, **kwargs) as host:
        next(iter(host))
        assert not any(b.tensors[0].is_pinned() for b in host._backend.ring.segments.values()), \
            "no device: nothing is registered with CUDA"
    with AsyncLoader(list(range(40)), device=device, processes=2, **kwargs) as loader:
        got = []
        for number, batch in enumerate(loader):
            assert batch.device == device
            got.append(batch.cpu())
            if number < len(loader) - 1:
                assert list(loader._passes.driver.pending_copies) == [number + 1] or number == 0, \
                    "batch k+1's copy starts when batch k is handed out"
            time.sleep(0.2)  # the next batch completes meanwhile
        assert all(b.tensors[0].is_pinned() for b in loader._backend.pipelines.ring.segments.values())
    assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))


def count_native_threads(data):
    """A decode that reports the native thread settings it runs under, as its sample."""
    import cv2

    return np.array([cv2.getNumThreads(), torch.get_num_threads()], np.int64)


def test_children_run_native_libraries_on_one_thread_per_decode_thread():
    """As in-process: no OpenCV or torch thread pool inside each decode thread of a child."""
    with AsyncLoader(list(range(8)), batch_size=4, read=False, decode=count_native_threads, processes=1) as loader:
        seen = {tuple(row.tolist()) for batch in loader for row in batch}
    assert seen == {(1, 1)}


def test_a_raised_sample_error_does_not_keep_its_segment():
    """on_error="raise": the failing batch's shared segment goes back to the ring, so iterating
    again and again reuses segments instead of leaving one in use for each error."""
    with AsyncLoader(list(range(1, 14)), batch_size=4, shuffle=False, read=False, decode=fails_if_a_multiple_of_seven,
                     processes=1, prefetch=1) as loader:  # item 7 fails: the second batch, once the layout is known
        for _ in range(4):
            with pytest.raises(SampleError):
                list(loader)
        segments = loader._backend.pipelines.ring.segments
        # At most the batch a child was still filling when the last run stopped (it comes back
        # once the child confirms); before, each error kept one more segment for good.
        assert sum(buffer.in_pipeline for buffer in segments.values()) <= 1
