"""Nothing accumulates: descriptors, sockets, threads and memory stay flat over many epochs.

The short version runs in CI; `pytest -m slow` runs the 50-epoch soak."""

import gc
import threading
import warnings

import psutil
import pytest

from asyncload import AsyncLoader, ImageDecoder, image_folder


def process_figures() -> tuple[int, int, int]:
    gc.collect()
    process = psutil.Process()
    return process.num_fds(), threading.active_count(), process.memory_info().rss


def test_early_exits_leave_no_descriptor_or_socket_open(s3_jpeg_bucket, s3_options):
    source = image_folder(s3_jpeg_bucket, storage_options=s3_options)

    def run(stop_after: int | None) -> None:
        loader = AsyncLoader(source, batch_size=4, decode=ImageDecoder(16), storage_options=s3_options)
        for number, _ in enumerate(loader):
            if number == stop_after:
                break
        del loader

    run(None)  # first use opens what stays open by design (imports, the TLS context, ...)
    fds_before = psutil.Process().num_fds()
    connections_before = connections()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        for stop_after in (None, 0, 2, None):
            run(stop_after)
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]
    # SeaweedFS keeps connections alive: those of other clients (the fixtures' uploads) may close
    # meanwhile, so none may be added, rather than none changed
    assert psutil.Process().num_fds() <= fds_before
    assert connections() <= connections_before


def connections() -> set:
    return {(c.laddr, c.raddr) for c in psutil.Process().net_connections()}



@pytest.mark.parametrize("epochs", [pytest.param(6, id="short"), pytest.param(50, id="soak", marks=pytest.mark.slow)])
def test_many_epochs_stay_flat(jpeg_folder, epochs):
    source = image_folder(str(jpeg_folder))
    with AsyncLoader(source, batch_size=5, decode=ImageDecoder(32, train=True)) as loader:
        figures = []
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            assert sum(len(labels) for _, labels in loader) == len(source)
            figures.append(process_figures())
    fds, threads, rss = zip(*figures[2:])
    # Nothing grows from epoch to epoch. (Not "nothing changes": connections that earlier tests'
    # clients keep alive to the S3 server may close at idle in the middle of this test.)
    assert fds[-1] <= fds[0] and max(fds) <= fds[0] + 1, fds
    assert threads[-1] <= threads[0] and max(threads) <= threads[0] + 1, threads
    assert max(rss) - min(rss) < 16 * 2**20, "memory must not grow from epoch to epoch"
