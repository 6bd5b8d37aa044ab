"""settings.py: the loader's arguments checked once into one frozen, printable value
(``loader.settings``) that every stage reads, child processes included (they get it pickled)."""

import dataclasses
import pickle
import re

import numpy as np
import pytest

from asyncload import AsyncLoader, tar_shards
from asyncload.settings import LoaderSettings
from tests.conftest import asyncload_threads

LIMIT = 1000  # max_sample_bytes in the child test
RETRY_S = 0.05  # read_retry_seconds there: the two retries a time budget always gives take longer


# ----- what the children run (at module level: a child finds them by name) -----


def length(data):
    return np.int64(len(data))


def sized_or_down(key):
    """A user read: ``"down"`` fails as storage does (retried); ``"<n> bytes"`` gives n bytes."""
    if key == "down":
        raise ConnectionResetError("storage is down")
    return bytes(int(key.split()[0]))


# ----- the value -----


def test_the_value_is_frozen_and_the_loaders_attribute_read_only():
    with AsyncLoader(list(range(4)), read=False, decode=length, num_threads=2, processes=0) as loader:
        settings = loader.settings
        with pytest.raises(dataclasses.FrozenInstanceError):
            settings.read_retry_seconds = 1.0
        with pytest.raises(AttributeError):
            loader.settings = dataclasses.replace(settings, batch_size=1)
        assert loader.settings is settings and settings.read_retry_seconds == 60.0


def test_the_value_holds_the_defaults_resolved():
    with AsyncLoader([("a.jpg", 0), ("b.jpg", 1)], num_threads="auto", io_concurrency="auto", isolate=False,
                     processes=0) as loader:
        settings = loader.settings
    assert settings.labelled and type(settings.decode).__name__ == "ImageDecoder"
    assert settings.auto_threads and settings.threads_started >= settings.num_threads >= 1
    assert settings.auto_io and settings.io_concurrency == 16  # where "auto" starts for single objects
    assert settings.processes == 0 and not settings.adaptive and not settings.skip_errors


def test_what_runs_only_here_is_not_sent_to_a_child():
    """``collate`` runs at hand-out and ``normalize`` in the device stage, both in this process: a
    child gets neither (a ``normalize`` of CUDA tensors would start CUDA in every child)."""
    with AsyncLoader(list(range(4)), read=False, decode=length, processes=0, collate=list,
                     normalize=([0.5], [0.25])) as loader:
        sent = loader.settings.for_children()
    assert sent["collate"] is None and sent["normalize"] is None
    assert sent["decode"] is length and set(sent) == {field.name for field in dataclasses.fields(loader.settings)}


def test_the_repr_names_every_argument_and_summarises_a_large_source():
    source = [f"s3://bucket/train/{i:06d}.jpg" for i in range(100_000)]
    with AsyncLoader(source, read=False, decode=length, num_threads=2, processes=0, read_retry_seconds=7.5,
                     storage_options={"key": "AKIAEXAMPLE", "secret": "hunter2", "endpoint_url": "http://s3"},
                     collate=lambda batch: batch) as loader:
        shown = repr(loader.settings)
    assert shown.startswith("LoaderSettings(source=<list of 100,000 items: 's3://bucket/train/000000.jpg', "
                            "'s3://bucket/train/000001.jpg', ...>, batch_size=256, ")
    for field in dataclasses.fields(LoaderSettings):
        assert f" {field.name}=" in shown or shown.startswith(f"LoaderSettings({field.name}=")
    assert "read_retry_seconds=7.5" in shown and "decode=length" in shown and "collate=" in shown
    assert "000099" not in shown and len(shown) < 2000
    assert "'endpoint_url': 'http://s3'" in shown and "hunter2" not in shown and "AKIAEXAMPLE" not in shown


def test_the_repr_hides_credentials_under_option_names_without_a_secret_word():
    """storage_options as fsspec's filesystems take them: webdav4's ``auth=(user, password)``,
    sftp's ``password``/``pkey``/``passphrase``, an HTTP ``Cookie`` header: each key shown, its
    value not."""
    options = {"auth": ("alice", "hunter2"), "pass": "hunter2", "pkey": "hunter2", "passphrase": "hunter2",
               "creds": "hunter2", "client_kwargs": {"headers": {"Cookie": "sid=hunter2"}, "proxy_auth": "hunter2"},
               "endpoint_url": "http://s3"}
    with AsyncLoader(list(range(4)), read=False, decode=length, num_threads=2, processes=0,
                     storage_options=options) as loader:
        shown = repr(loader.settings)
    assert "hunter2" not in shown
    for key in ("'auth': ", "'pass': ", "'pkey': ", "'passphrase': ", "'creds': ", "'Cookie': ", "'proxy_auth': "):
        assert key + "'***'" in shown, key
    assert "'endpoint_url': 'http://s3'" in shown


def test_the_value_pickles_equal():
    with AsyncLoader([(f"{i}.bin", i % 3) for i in range(50)], batch_size=8, decode=length, num_threads=2,
                     processes=0, on_error="skip", max_sample_bytes=None, read_retries=3) as loader:
        settings = loader.settings
    again = pickle.loads(pickle.dumps(settings))
    assert again == settings and again is not settings and repr(again) == repr(settings)


@pytest.mark.parametrize("processes", [0, 2])
def test_a_child_pipeline_reads_with_the_parents_budgets(processes):
    """The budgets given to the loader are the ones its reader holds a sample to, in this process
    and in each child (which gets the value pickled): a sample over ``max_sample_bytes`` fails
    naming that limit, and a read that storage keeps failing gives up after the time budget
    ``read_retry_seconds`` (the default, 60 s, would name itself)."""
    items = ["10 bytes", f"{LIMIT + 1} bytes", "down", f"{LIMIT} bytes"]
    with AsyncLoader(items, batch_size=2, shuffle=False, read=sized_or_down, decode=length, num_threads=2,
                     max_sample_bytes=LIMIT, read_retry_seconds=RETRY_S, on_error="skip", max_failures=2,
                     processes=processes) as loader:
        assert [size for batch in loader for size in batch.tolist()] == [10, LIMIT]
        failures = {failure.item: failure for failure in loader.stats.failures}
    assert set(failures) == {f"{LIMIT + 1} bytes", "down"}
    assert failures[f"{LIMIT + 1} bytes"].error == (
        f"SampleTooLarge: the object is {LIMIT + 1} bytes (0.0 MiB), over max_sample_bytes={LIMIT} "
        "(0.0 MiB); pass AsyncLoader(max_sample_bytes=...) a larger budget to read it")
    assert re.fullmatch(r"ConnectionResetError: storage is down \(storage failed for \d+\.\d s, attempt 3 "
                        r"\(read_retry_seconds=0\.05\)\)", failures["down"].error), failures["down"].error
    assert not asyncload_threads()


# ----- the checks: each argument named, at construction, as before -----


CHECKS = [
    (dict(on_error="ignore"), ValueError, "on_error must be 'raise' or 'skip', got 'ignore'"),
    (dict(io_concurrency=0), ValueError, "io_concurrency must be a positive integer, 'auto' or None, got 0"),
    (dict(io_concurrency="many"), ValueError, "io_concurrency must be a positive integer, 'auto' or None, got 'many'"),
    (dict(num_threads=0), ValueError, "num_threads must be a positive integer, 'auto' or None, got 0"),
    (dict(num_threads=-1), ValueError, "num_threads must be a positive integer, 'auto' or None, got -1"),
    (dict(num_threads="many"), ValueError, "num_threads must be a positive integer, 'auto' or None, got 'many'"),
    (dict(num_threads=2.5), ValueError, "num_threads must be a positive integer, 'auto' or None, got 2.5"),
    (dict(read_timeout=0), ValueError, "read_timeout must be a positive number, got 0"),
    (dict(read_timeout=None), ValueError, "read_timeout must be a positive number, got None"),
    (dict(prefetch=0), ValueError, "prefetch must be an integer of at least 1, got 0"),
    (dict(prefetch=2.5), ValueError, "prefetch must be an integer of at least 1, got 2.5"),
    (dict(seed=None), ValueError, "seed must be an integer, got None"),
    (dict(read_retries=-1), ValueError, "read_retries must be None or a non-negative integer, got -1"),
    (dict(read_retries=1.5), ValueError, "read_retries must be None or a non-negative integer, got 1.5"),
    (dict(read=True), TypeError, "read must be None, False or a callable, got True"),
    (dict(read="s3"), TypeError, "read must be None, False or a callable, got 's3'"),
    (dict(max_failures=1.5), ValueError, "max_failures as a fraction must be in [0, 1), got 1.5"),
    (dict(max_failures=-1), ValueError, "max_failures must not be negative, got -1"),
    (dict(decode_timeout=0), ValueError, "decode_timeout must be a positive number or None, got 0"),
    (dict(max_sample_bytes=-1), ValueError, "max_sample_bytes must be a positive number or None, got -1"),
    (dict(read_retry_seconds=None), ValueError, "read_retry_seconds must be a positive number, got None"),
    (dict(read_retry_seconds=True), ValueError, "read_retry_seconds must be a positive number, got True"),
    (dict(processes=-1), ValueError, "processes must be None, a non-negative integer or 'auto', got -1"),
    (dict(isolate=True, processes=2), ValueError, "isolate=True is processes=1; got processes=2 as well"),
    (dict(device="meta"), ValueError, "device must be None, 'cpu' or a CUDA device, got meta"),
    (dict(gpu_decode="always"), ValueError, "gpu_decode must be 'auto', True or False, got 'always'"),
    (dict(gpu_decode=1), ValueError, "gpu_decode must be 'auto', True or False, got 1"),
]


@pytest.mark.parametrize("arguments, kind, message", CHECKS, ids=[str(check[0]) for check in CHECKS])
def test_each_argument_is_checked_at_construction(arguments, kind, message):
    arguments = {"read": False, "decode": length, **arguments}
    with pytest.raises(kind) as caught:
        AsyncLoader(list(range(4)), **arguments)
    assert str(caught.value) == message
    assert not asyncload_threads()


def test_a_shard_sources_arguments_are_checked(shard_dir):
    with pytest.raises(ValueError) as caught:
        AsyncLoader(tar_shards(str(shard_dir)), read=sized_or_down)
    assert str(caught.value) == "a shard source is read by the loader itself: leave read=None"
    with pytest.raises(ValueError) as caught:
        AsyncLoader(tar_shards(str(shard_dir), members="all"))
    assert str(caught.value) == ("tar_shards(..., members='all') gives each sample as {extension: bytes}: "
                                 "pass a decode= for it")
