import asyncio
import dataclasses
import gc
import inspect
import re
import signal
import threading
import time

import numpy as np
import pytest
import torch

from asyncload import AsyncLoader, GpuImageDecoder, ImageDecoder, SampleError, image_folder
from asyncload.batch.layout import Field
from tests.conftest import CLASSES, PER_CLASS, asyncload_threads, identify, make_jpeg


def index_loader(n=23, **kwargs) -> AsyncLoader:
    """Items are integers; each sample is a row of its own index, so batches show what was delivered."""
    kwargs.setdefault("batch_size", 5)
    return AsyncLoader(list(range(n)), read=False, decode=lambda i: np.full(3, i, np.int64), **kwargs)


def delivered(batches) -> list[int]:
    return [int(row[0]) for batch in batches for row in batch]


@pytest.mark.parametrize("shuffle", [False, True])
def test_every_sample_exactly_once_per_epoch(shuffle):
    with index_loader(shuffle=shuffle, seed=1) as loader:
        for epoch in range(2):
            loader.set_epoch(epoch)
            batches = list(loader)
            assert [len(b) for b in batches] == [5, 5, 5, 5, 3]
            assert sorted(delivered(batches)) == list(range(23))


@pytest.mark.parametrize("processes", [0, 2])
def test_a_loader_iterated_without_a_name_lives_until_its_pass_ends(processes):
    """``for batch in AsyncLoader(...)`` keeps no reference to the loader but its pass: a
    collection mid-pass must not close it (a collected loader closes itself)."""
    seen = []
    for batch in AsyncLoader(list(range(64)), batch_size=8, shuffle=False, read=False, decode=np.asarray,
                             processes=processes):
        gc.collect()
        seen += batch.tolist()
    assert seen == list(range(64))


class CancelledInside:
    """An async ``read`` whose client cancels its own request for item 5 (not a stop)."""

    async def __call__(self, item):
        if item == 5:
            raise asyncio.CancelledError("the client gave up on its request")
        return item


@pytest.mark.parametrize("processes", [0, 2])
def test_a_read_cancelled_inside_its_client_fails_its_sample_and_no_row_goes_out_unwritten(processes):
    loader = AsyncLoader(list(range(16)), batch_size=4, shuffle=False, read=CancelledInside(), decode=np.asarray,
                         processes=processes, on_error="skip", max_failures=1)
    with loader:
        seen = [value for batch in loader for value in batch.tolist()]
    assert 5 not in seen and sorted(seen) == [value for value in range(16) if value != 5]
    assert [(failure.item, failure.stage) for failure in loader.stats.failures] == [(5, "read")]


def test_rows_hold_the_sample_at_that_position_of_the_order():
    with index_loader(shuffle=True, seed=4) as loader:
        got = delivered(loader)
        assert got == loader.sampler.order(0).tolist()


def test_images_and_labels_match_the_files(jpeg_folder):
    source = image_folder(str(jpeg_folder))
    with AsyncLoader(source, batch_size=7, decode=ImageDecoder(size=32), num_threads=2) as loader:
        seen = []
        for images, labels in loader:
            assert images.shape[1:] == (32, 32, 3) and images.dtype == torch.uint8
            assert labels.dtype == torch.int64
            for image, label in zip(images.numpy(), labels.tolist()):
                found_label, index = identify(image)
                assert found_label == label
                seen.append((label, index))
    assert sorted(seen) == [(l, i) for l in range(len(CLASSES)) for i in range(PER_CLASS)]


def test_default_decode_gives_224_uint8(jpeg_folder):
    with AsyncLoader(image_folder(str(jpeg_folder)), batch_size=4) as loader:
        images, labels = next(iter(loader))
    assert images.shape == (4, 224, 224, 3) and labels.shape == (4,)


def test_items_without_labels_yield_the_images_alone(jpeg_folder):
    urls = [str(p) for p in sorted(jpeg_folder.rglob("*.jpg"))][:6]
    with AsyncLoader(urls, batch_size=3, decode=ImageDecoder(size=16)) as loader:
        batch = next(iter(loader))
    assert isinstance(batch, torch.Tensor) and batch.shape == (3, 16, 16, 3)


def test_same_seed_same_order_and_set_epoch_reshuffles():
    def order(seed, epoch):
        with index_loader(seed=seed) as loader:
            loader.set_epoch(epoch)
            return delivered(loader)

    assert order(0, 0) == order(0, 0)
    assert order(0, 0) != order(0, 1)
    assert order(0, 0) != order(1, 0)


def test_drop_last_gives_full_batches_only():
    with index_loader(drop_last=True) as loader:
        batches = list(loader)
    assert len(batches) == len(loader) == 4 and all(len(b) == 5 for b in batches)


def test_shards_are_disjoint_and_cover_the_epoch():
    shards = []
    for rank in range(3):
        with index_loader(n=30, rank=rank, world_size=3, seed=2) as loader:
            shards.append(delivered(loader))
            assert len(loader) == 2
    assert sorted(sum(shards, [])) == list(range(30))


def test_kept_batches_stay_intact():
    """list(loader) keeps every batch: none may be overwritten by a later one."""
    with index_loader(n=40, batch_size=4, prefetch=1) as loader:
        batches = list(loader)
        expected = loader.sampler.order(0).reshape(10, 4)
    for batch, rows in zip(batches, expected):
        assert batch[:, 0].tolist() == rows.tolist()


def test_released_batches_are_recycled():
    """In a plain loop the ring reuses its buffers instead of allocating one per batch."""
    with index_loader(n=200, batch_size=4, prefetch=2) as loader:
        pointers = {batch.data_ptr() for batch in loader}
    assert len(pointers) <= 2 + 2


@pytest.mark.parametrize("with_labels", [False, True])
def test_user_decode_returning_tuple_and_dict(with_labels):
    items = [(i, i % 3) for i in range(10)] if with_labels else list(range(10))

    def read(item):
        return item

    def as_tuple(i):
        return np.full((2, 2), i, np.float32), np.int32(i * 2)

    with AsyncLoader(items, batch_size=4, shuffle=False, read=read, decode=as_tuple) as loader:
        first = next(iter(loader))
    (values, doubled), labels = first if with_labels else (first, None)
    assert values.shape == (4, 2, 2) and values.dtype == torch.float32
    assert doubled.tolist() == [0, 2, 4, 6] and doubled.dtype == torch.int32
    if with_labels:
        assert labels.tolist() == [0, 1, 2, 0]

    with AsyncLoader(list(range(10)), batch_size=4, shuffle=False, read=False,
                     decode=lambda i: {"x": np.full(3, i), "name_len": len(str(i))}) as loader:
        batch = next(iter(loader))
    assert set(batch) == {"x", "name_len"} and batch["x"][:, 0].tolist() == [0, 1, 2, 3]


def test_async_read_function_is_awaited():
    import asyncio

    async def read(key):
        await asyncio.sleep(0.001)
        return key * 10

    with AsyncLoader(list(range(12)), batch_size=4, shuffle=False, read=read, decode=lambda v: np.int64(v)) as loader:
        assert [b.tolist() for b in loader] == [[0, 10, 20, 30], [40, 50, 60, 70], [80, 90, 100, 110]]


def test_in_order_false_still_delivers_each_batch_once():
    last_decoded = threading.Event()

    def decode(i):
        if 0 < i < 5:  # the first batch waits for the last sample (item 0 tells the layout first)
            last_decoded.wait(10)
        if i == 24:
            last_decoded.set()
        return np.int64(i)

    # 8 threads whatever the cores: 4 wait in the first batch, the others decode the rest
    with AsyncLoader(list(range(25)), batch_size=5, shuffle=False, read=False, decode=decode, in_order=False, prefetch=4,
                     num_threads=8) as loader:
        batches = [b.tolist() for b in loader]
    assert sorted(batches) == [list(range(k, k + 5)) for k in range(0, 25, 5)]
    assert batches[0] != [0, 1, 2, 3, 4]


def test_missing_file_raises_sample_error_naming_it(tmp_path, jpeg_folder):
    good = str(next(jpeg_folder.rglob("*.jpg")))
    missing = str(tmp_path / "gone.jpg")
    with AsyncLoader([good, good, missing, good], batch_size=2, shuffle=False, decode=ImageDecoder(16)) as loader:
        batches = iter(loader)
        next(batches)
        with pytest.raises(SampleError) as caught:
            next(batches)
    assert caught.value.item == missing and caught.value.stage == "read"
    assert missing in str(caught.value)
    assert isinstance(caught.value.__cause__, FileNotFoundError)
    assert len(loader.stats.failures) == 1


def test_corrupt_jpeg_raises_sample_error_at_decode(tmp_path):
    path = tmp_path / "broken.jpg"
    path.write_bytes(make_jpeg((1, 2, 3))[:300])
    with AsyncLoader([str(path)], batch_size=1, decode=ImageDecoder(16)) as loader:
        with pytest.raises(SampleError, match="broken.jpg.*decode") as caught:
            list(loader)
    assert isinstance(caught.value.__cause__, ValueError)


def test_error_in_first_sample_of_a_user_decode(tmp_path):
    def decode(i):
        raise RuntimeError(f"cannot decode {i}")

    with index_loader(n=4, shuffle=False) as loader:
        pipes = loader._backend.pipelines  # the next run's pipeline reads its settings
        pipes.settings = dataclasses.replace(pipes.settings, decode=decode)
        with pytest.raises(SampleError, match="sample 0 failed at decode: RuntimeError: cannot decode 0"):
            list(loader)


def test_decoded_shape_that_changes_turns_ragged_and_a_dtype_that_changes_is_an_error():
    with AsyncLoader(list(range(6)), batch_size=3, shuffle=False, read=False, decode=lambda i: np.zeros(1 + (i == 4))) as loader:
        assert [[len(row) for row in batch.unbind()] for batch in loader] == [[1, 1, 1], [1, 2, 1]]
    decode = lambda i: np.zeros(1 + (i == 4), np.float64 if i == 4 else np.int32)  # noqa: E731  (int32 cannot hold it)
    with AsyncLoader(list(range(6)), batch_size=3, shuffle=False, read=False, decode=decode) as loader:
        with pytest.raises(SampleError, match=r"sample 4 failed at decode: FieldMismatch: .*float64 array of "
                                              r"shape \(2,\)"):
            list(loader)


def test_break_stops_every_thread():
    loader = index_loader(n=500, batch_size=2)
    for _ in loader:
        assert asyncload_threads(), "the pipeline runs while iterating"
        break
    assert not asyncload_threads()
    loader.close()


def test_exception_in_the_users_loop_stops_every_thread():
    loader = index_loader(n=500, batch_size=2)
    with pytest.raises(ZeroDivisionError):
        for _ in loader:
            1 / 0
    assert not asyncload_threads()


def test_close_during_iteration_stops_every_thread_and_refuses_new_epochs():
    loader = index_loader(n=500, batch_size=2)
    batches = iter(loader)
    next(batches)
    loader.close()
    assert not asyncload_threads()
    with pytest.raises(RuntimeError, match="closed"):
        iter(loader)


def test_garbage_collection_stops_every_thread():
    loader = index_loader(n=500, batch_size=2)
    batches = iter(loader)
    next(batches)
    del batches, loader
    gc.collect()
    assert not asyncload_threads()


def test_ctrl_c_while_waiting_for_a_batch_stops_every_thread(ctrl_c_raises):
    """The first batch takes 100 reads of 0.2 s, two at a time (10 s): a Ctrl-C once the reads
    are out ends the loop after the reads in flight, not the batch (counted: the reads begun stay
    short of the batch's 100; a loop that finished the batch first began them all)."""
    reading = threading.Event()
    begun: list[int] = []

    def slow_read(key):
        begun.append(key)
        reading.set()
        time.sleep(0.2)  # the workload: a slow storage
        return key

    def ctrl_c_once_reading() -> None:
        if reading.wait(60):
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # a real Ctrl-C

    loader = AsyncLoader(list(range(200)), batch_size=100, read=slow_read, decode=lambda i: np.int64(i),
                         io_concurrency=2)
    threading.Thread(target=ctrl_c_once_reading).start()
    with pytest.raises(KeyboardInterrupt):
        for _ in loader:
            pass
    assert 0 < len(begun) < 100, f"{len(begun)} reads begun: the Ctrl-C waited for the batch"
    assert not asyncload_threads()
    loader.close()


def test_a_new_iteration_starts_the_next_epoch_afresh_and_ends_the_old_one():
    with index_loader(n=50) as loader:
        first = iter(loader)
        next(first)
        assert delivered(iter(loader)) == loader.sampler.order(1).tolist()
        assert not asyncload_threads()
        with pytest.raises(RuntimeError, match="iteration has ended"):
            next(first)


def test_state_dict_resumes_with_the_remaining_batches_in_order():
    with index_loader(n=40, batch_size=4, shuffle=True, seed=9) as loader:
        loader.set_epoch(3)
        uninterrupted = [b.tolist() for b in loader]
    with index_loader(n=40, batch_size=4, shuffle=True, seed=9) as loader:
        loader.set_epoch(3)
        batches = iter(loader)
        head = [next(batches).tolist() for _ in range(4)]
        state = loader.state_dict()
        del batches
    assert head == uninterrupted[:4]
    assert state["delivered"] == [[0, 16]] and len(repr(state)) < 300

    reads = []

    def counting_decode(i):
        reads.append(i)
        return np.full(3, i, np.int64)

    with AsyncLoader(list(range(40)), batch_size=4, shuffle=True, seed=9, read=False, decode=counting_decode) as resumed:
        resumed.load_state_dict(state)
        rest = [b.tolist() for b in resumed]
    assert rest == uninterrupted[4:]
    delivered_before = {row[0] for batch in head for row in batch}
    assert not delivered_before & set(reads), "delivered samples must not be read again"
    assert sorted(reads) == sorted(set(range(40)) - delivered_before), "the rest is read once each"


def test_load_state_dict_rejects_another_configuration():
    with index_loader(seed=1) as a, index_loader(seed=2) as b:
        with pytest.raises(ValueError, match="seed"):
            b.load_state_dict(a.state_dict())


@pytest.mark.parametrize("key, other", [
    ("shuffle", dict(shuffle=False)),                  # another permutation (here: none)
    ("source", dict(source=list(range(100, 140)))),   # another source of the same length
    ("drop_last", dict(drop_last=True)),
])
def test_resume_refuses_a_state_of_another_order(key, other):
    """Resuming on another order would skip some samples and repeat others, silently."""
    base = dict(source=list(range(40)), batch_size=4, shuffle=True, seed=9, read=False, decode=np.int64)
    with AsyncLoader(**base) as loader:
        iterator = iter(loader)
        next(iterator)
        state = loader.state_dict()
        iterator.close()
    with AsyncLoader(**{**base, **other}) as changed:
        with pytest.raises(ValueError, match=f"{key}=.*another order"):
            changed.load_state_dict(state)
    with AsyncLoader(**base) as same:
        same.load_state_dict(state)
        assert sum(len(b) for b in same) == 36


def test_normalize_gives_float_nchw_on_the_cpu(jpeg_folder):
    source = image_folder(str(jpeg_folder))
    mean, std = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)
    with AsyncLoader(source, batch_size=4, shuffle=False, decode=ImageDecoder(16)) as plain, \
         AsyncLoader(source, batch_size=4, shuffle=False, decode=ImageDecoder(16), normalize=(mean, std)) as normed:
        raw, _ = next(iter(plain))
        floats, labels = next(iter(normed))
    assert floats.shape == (4, 3, 16, 16) and floats.dtype == torch.float32
    expected = (raw.permute(0, 3, 1, 2).float() / 255 - 0.5) / 0.25
    torch.testing.assert_close(floats, expected)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_cuda_device_without_cuda_fails_at_construction():
    with pytest.raises(RuntimeError, match=r"device='cuda'.*torch.cuda.is_available\(\) is False"):
        AsyncLoader(["x"], device="cuda")


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="on_error"):
        AsyncLoader([], on_error="ignore")
    with pytest.raises(ValueError, match="prefetch"):
        AsyncLoader([], prefetch=0)
    with pytest.raises(ValueError, match="batch_size"):
        AsyncLoader([], batch_size=0)


def test_empty_source_gives_no_batches():
    with AsyncLoader([], batch_size=4) as loader:
        assert len(loader) == 0 and list(loader) == []


def test_memory_filesystem(jpeg_folder):
    import fsspec

    fs = fsspec.filesystem("memory")
    for label, path in enumerate(sorted(jpeg_folder.glob("*/0.jpg"))):
        fs.pipe_file(f"/asyncload-test/{label}.jpg", path.read_bytes())
    items = [(f"memory://asyncload-test/{label}.jpg", label) for label in range(len(CLASSES))]
    with AsyncLoader(items, batch_size=3, shuffle=False, decode=ImageDecoder(16)) as loader:
        images, labels = next(iter(loader))
    assert [identify(image) for image in images.numpy()] == [(label, 0) for label in range(len(CLASSES))]
    fs.rm("/asyncload-test", recursive=True)


def test_resume_with_shuffling_and_sharding():
    def run(rank, state=None, stop_after=None):
        with index_loader(n=50, batch_size=3, seed=7, rank=rank, world_size=2) as loader:
            loader.set_epoch(2)
            if state:
                loader.load_state_dict(state)
            out = []
            for batch in loader:
                out.append(batch[:, 0].tolist())
                if len(out) == stop_after:
                    return out, loader.state_dict()
            return out, None

    for rank in range(2):
        full, _ = run(rank)
        head, state = run(rank, stop_after=3)
        rest, _ = run(rank, state)
        assert head + rest == full


def test_native_libraries_run_one_thread_per_decode_thread_and_the_users_settings_come_back(jpeg_folder):
    """OpenCV's pool is one process-wide setting: one thread while an epoch runs (16 decode threads
    x OpenCV's own 16 oversubscribe a 16-core node), the user's value again afterwards. torch's
    intra-op threads are set per thread, in the decode threads only."""
    import cv2

    cv2.setNumThreads(3)
    torch_threads = torch.get_num_threads()
    seen = []

    def decode(data: bytes) -> np.ndarray:
        seen.append((cv2.getNumThreads(), torch.get_num_threads()))
        return np.zeros(2, np.uint8)

    try:
        with AsyncLoader(image_folder(str(jpeg_folder)), batch_size=4, decode=decode, num_threads=2) as loader:
            for _ in loader:
                assert cv2.getNumThreads() == 1
                assert torch.get_num_threads() == torch_threads
        assert seen and set(seen) == {(1, 1)}
        assert cv2.getNumThreads() == 3
    finally:
        cv2.setNumThreads(-1)


def test_a_pass_starts_at_the_first_next_not_at_iter():
    """As a DataLoader's sampler: Lightning makes an iterator to check the loader and drops it;
    that reads nothing and uses up no epoch, and set_epoch after iter() applies."""
    reads = []

    def decode(i):
        reads.append(i)
        return np.full(3, i, np.int64)

    with AsyncLoader(list(range(40)), batch_size=4, read=False, decode=decode, shuffle=True, seed=3) as loader:
        iterator = iter(loader)
        assert not asyncload_threads(), "iter() starts no thread"
        del iterator
        assert reads == [] and loader.epoch == 0
        first = delivered(loader)
        assert first == loader.sampler.order(0).tolist(), "the dropped iterator used up no epoch"
        iterator = iter(loader)
        loader.set_epoch(5)  # between iter() and the first next(): applies
        assert delivered(iterator) == loader.sampler.order(5).tolist()
    assert not asyncload_threads()


@pytest.mark.parametrize("n, bad, full_batches", [
    (10, {1}, 2),  # the rest (positions 8, 9) replaces the skipped sample: still two full batches
    (8, {1}, 1),   # no rest: the batch left short is dropped, as drop_last drops a short one
])
def test_drop_last_with_skips_delivers_only_full_batches(n, bad, full_batches):
    others = set(range(8)) - bad  # the full batches' other samples
    begun: set[int] = set()
    all_begun = threading.Event()

    def decode(i):
        begun.add(i)
        if others <= begun:
            all_begun.set()
        if i in bad:
            # Fails once the producer has taken every full batch (prefetch=4): their other
            # samples' decodes have begun (the decision itself: tests/test_driver_logic.py).
            assert all_begun.wait(60), sorted(begun)
            raise ValueError("corrupt")
        return np.full(2, i, np.int64)

    with AsyncLoader(list(range(n)), batch_size=4, shuffle=False, read=False, decode=decode, drop_last=True,
                     on_error="skip", max_failures=1, prefetch=4, num_threads=2) as loader:
        batches = [b[:, 0].tolist() for b in loader]
    assert [len(b) for b in batches] == [4] * full_batches
    got = [v for b in batches for v in b]
    assert len(set(got)) == len(got) and not set(got) & bad
    if n == 10:
        assert sorted(got) == [0, 2, 3, 4, 5, 6, 7, 8]


class WholeBatches:
    """``decode`` as a decoder of whole batches (``decode_batch``, as ``GpuImageDecoder``): a stop
    waits for one that is busy (a decode of one sample, returned or written in place, is
    abandoned instead: test_hangs.py)."""

    batched = True
    field = Field((1,), np.dtype(np.int64))

    def __init__(self, decode):
        self.decode = decode

    def __call__(self, data):
        return np.atleast_1d(self.decode(data))

    def decode_batch(self, datas, keys, out, stream=None, rows=None):
        for data, row in zip(datas, rows):
            out[row] = int(self.decode(data))
        return {}, None, []


class CloseWaits:
    """Wraps the pipeline's ``wait_ended`` (what a stop waits on) to tell the test each time a
    stop waits for the thread the test holds: an event to act on, not a moment guessed."""

    def __init__(self, monkeypatch) -> None:
        import asyncload.pipeline.pipeline as pipeline

        self.held: threading.Thread | None = None  # the decode thread the test holds
        self.waits = 0  # the waits for it so far
        self.waiting = [threading.Event(), threading.Event()]  # set at the first wait, the second
        original = pipeline.wait_ended

        def wait_ended(threads, deadline):
            if self.held in threads:
                self.waits += 1
                for event in self.waiting[:self.waits]:
                    event.set()
            return original(threads, deadline)

        monkeypatch.setattr(pipeline, "wait_ended", wait_ended)


def test_a_close_cut_short_by_ctrl_c_is_finished_by_the_next(ctrl_c_raises, monkeypatch):
    """Ctrl-C while close() waits for a busy decode thread: a second close() must still end
    every thread (it used to return at once, leaving them running)."""
    closing = CloseWaits(monkeypatch)
    stuck = threading.Event()
    second_close_waits = closing.waiting[1]

    def decode(i):
        if i == 5:
            closing.held = threading.current_thread()
            stuck.set()
            second_close_waits.wait(60)  # busy until the second close() waits for it
        return np.int64(i)

    def ctrl_c_once_close_waits() -> None:
        if closing.waiting[0].wait(60):
            signal.pthread_kill(main, signal.SIGINT)  # a real Ctrl-C

    loader = AsyncLoader(list(range(40)), batch_size=4, shuffle=False, read=False, decode=WholeBatches(decode),
                         num_threads=2)
    iterator = iter(loader)
    next(iterator)
    assert stuck.wait(60), "the next batch's decode of 5 never started"  # else close() does not wait
    main = threading.main_thread().ident
    threading.Thread(target=ctrl_c_once_close_waits).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            loader.close()
        assert asyncload_threads(), "the decode thread is still busy"
        loader.close()
        assert closing.waits >= 2, "the second close() waited for the busy decode"
        assert not asyncload_threads()
    finally:
        second_close_waits.set()
    del iterator


def test_slices_and_arrays_kept_from_batches_stay_intact():
    """A CPU user who keeps only a slice, a row or a NumPy array of each batch: the ring must see
    them (they hold the buffer) and never write the next batches into them."""
    kept = []
    with index_loader(n=200, batch_size=4, shuffle=False) as loader:
        for k, batch in enumerate(loader):
            kept.append((k, [batch[1:3], batch[0], batch.numpy()[3:]][k % 3]))
    for k, part in kept:
        first = {0: 4 * k + 1, 1: 4 * k, 2: 4 * k + 3}[k % 3]
        assert int(np.asarray(part).reshape(-1)[0]) == first, f"batch {k}'s kept part was overwritten"


def test_a_stop_that_times_out_warns_once_and_close_finishes_it(monkeypatch):
    """A decode stuck past stop()'s bound: the end of the loop warns (once: dropping the iterator
    must not wait again), the loader keeps the run, and close() ends every thread, the GIL probe's
    included, once the decode returns."""
    import asyncload.pipeline.pipelines

    monkeypatch.setattr(asyncload.pipeline.pipelines, "STOP_TIMEOUT_S", 3.0)
    stuck, release = threading.Event(), threading.Event()

    closing = CloseWaits(monkeypatch)

    def decode(i):
        if i == 6:
            closing.held = threading.current_thread()
            stuck.set()
            release.wait(60)  # past the stop's 3 s for certain: set below
        return np.int64(i)

    loader = AsyncLoader(list(range(40)), batch_size=4, shuffle=False, read=False, decode=WholeBatches(decode),
                         num_threads=2)
    iterator = iter(loader)
    next(iterator)
    assert stuck.wait(60), "the next batch's decode of 6 never started"  # else the stop has nothing to wait for
    with pytest.warns(RuntimeWarning, match="still running"):
        iterator.close()  # the loop's end: its finally stops the run
    waits = closing.waits
    assert waits >= 1, "the stop waited for the decode"
    try:
        del iterator
        assert closing.waits == waits, "the dropped iterator waited again"
        assert asyncload_threads()
    finally:
        release.set()
    loader.close()
    assert not asyncload_threads()
    assert not [t for t in threading.enumerate() if t.name == "asyncload-gil-probe"]


def documented_arguments(cls) -> list[str]:
    """The names that begin an entry of the ``Args:`` section of ``cls``'s docstring."""
    doc = inspect.getdoc(cls)
    section = doc.split("\nArgs:\n", 1)[1]
    section = re.split(r"\n(?=\S)", section, maxsplit=1)[0]  # up to the next unindented line
    return re.findall(r"^    (\w+)\b", section, re.MULTILINE)


@pytest.mark.parametrize("cls", [AsyncLoader, ImageDecoder, GpuImageDecoder])
def test_every_parameter_is_documented_where_help_shows_it(cls):
    """help(AsyncLoader) shows the class docstring: each parameter has its entry there, in the
    signature's order, so a new parameter cannot go undocumented."""
    parameters = [name for name in inspect.signature(cls.__init__).parameters if name != "self"]
    assert documented_arguments(cls) == parameters
    assert "contract" not in cls.__doc__


@pytest.mark.parametrize("method", ["__iter__", "__len__", "set_epoch", "state_dict", "load_state_dict", "close"])
def test_public_methods_say_what_they_do(method):
    doc = inspect.getdoc(getattr(AsyncLoader, method))
    assert doc and len(doc.split()) >= 8, f"AsyncLoader.{method} needs a docstring"
