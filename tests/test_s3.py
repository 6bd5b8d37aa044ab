"""End to end against a real S3 server (SeaweedFS) on 127.0.0.1, through the default client."""

import pytest
import torch

from asyncload import AsyncLoader, ImageDecoder, SampleError, image_folder
from tests.support.s3server import LatencyProxy, storage_options
from tests.conftest import epoch



def test_an_epoch_from_s3_equals_the_local_one(jpeg_folder, s3_jpeg_bucket, s3_options):
    local = epoch(image_folder(str(jpeg_folder)))
    remote = epoch(image_folder(s3_jpeg_bucket, storage_options=s3_options), storage_options=s3_options)
    assert len(local) == len(remote) == 5
    for (li, ll), (ri, rl) in zip(local, remote):
        assert torch.equal(ll, rl) and torch.equal(li, ri)


def test_a_missing_object_names_its_url(s3_jpeg_bucket, s3_options):
    url = f"{s3_jpeg_bucket}/cat/no-such-image.jpg"
    with AsyncLoader([url], batch_size=1, storage_options=s3_options) as loader:
        with pytest.raises(SampleError, match="no-such-image.jpg.*read: FileNotFoundError"):
            list(loader)


def test_reads_through_first_byte_latency_overlap(s3_server, s3_jpeg_bucket, s3_options, jpeg_folder):
    """24 objects behind 0.2 s of latency each: one after the other would take 4.8 s. Overlap is
    shown by the reads in flight at once (a busy machine slows them all, but they still overlap)."""
    with LatencyProxy(s3_server.port, (0.2, 0.2)) as proxy:
        options = storage_options(proxy.endpoint_url)
        source = image_folder(s3_jpeg_bucket, storage_options=s3_options)
        with AsyncLoader(source, batch_size=24, storage_options=options, decode=ImageDecoder(16)) as loader:
            (images, labels), = list(loader)
    assert len(labels) == 24
    assert loader.stats.as_dict()["reads_in_flight/peak"] >= 12, loader.stats.as_dict()


def test_the_server_takes_a_bucket_per_test_module(s3_options):
    """SeaweedFS gives each bucket volumes of its own; with its default cap the third bucket's
    writes failed, whatever the client."""
    from tests.conftest import setup_s3fs

    with setup_s3fs(s3_options) as fs:
        for number in range(4):
            bucket = f"asyncload-extra-{number}"
            if not fs.exists(bucket):
                fs.mkdir(bucket)
            fs.pipe_file(f"{bucket}/object", b"%d" % number)
    source = [f"s3://asyncload-extra-{number}/object" for number in range(4)]
    with AsyncLoader(source, batch_size=4, shuffle=False, decode=lambda data: torch.tensor(int(data)), storage_options=s3_options) as loader:
        (batch,) = list(loader)
    assert batch.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("client", ["obstore", "fsspec"])
def test_an_object_over_max_sample_bytes_fails_alone_naming_its_size(s3_options, client):
    """Each client reads at most max_sample_bytes + 1 bytes of it (a ranged GET: no request
    added per sample), then asks its size for the message; an empty object still reads."""
    from tests.conftest import make_bucket, setup_s3fs

    with setup_s3fs(s3_options) as fs:
        make_bucket(fs)
        fs.pipe_file("asyncload-test/sizes/big.bin", b"x" * (2 << 20))
        fs.pipe_file("asyncload-test/sizes/fits.bin", b"y" * (1 << 20))
        fs.pipe_file("asyncload-test/sizes/empty.bin", b"")
    options = {**s3_options, "client": client}
    items = [f"s3://asyncload-test/sizes/{name}.bin" for name in ("fits", "big", "empty")]
    with AsyncLoader(items, batch_size=3, shuffle=False, decode=lambda data: torch.tensor(len(data)),
                     storage_options=options, on_error="skip", max_failures=1, max_sample_bytes=1 << 20) as loader:
        (batch,) = list(loader)
    assert batch.tolist() == [1 << 20, 0]
    (failure,) = loader.stats.failures
    assert failure.item == items[1] and failure.error == (
        f"SampleTooLarge: the object is 2097152 bytes (2.0 MiB), over max_sample_bytes=1048576 (1.0 MiB); "
        "pass AsyncLoader(max_sample_bytes=...) a larger budget to read it")
    assert loader.stats.retries == 0


def test_a_missing_object_fails_at_once_under_the_time_budget(s3_jpeg_bucket, s3_options):
    import time

    started = time.monotonic()
    with AsyncLoader([f"{s3_jpeg_bucket}/cat/no-such-image.jpg"], batch_size=1, storage_options=s3_options) as loader:
        with pytest.raises(SampleError, match=r"read: FileNotFoundError"):
            list(loader)
    assert loader.stats.retries == 0 and time.monotonic() - started < 30, "not retried for 60 s (loose for a busy box)"


def test_obstore_reads_an_object_no_further_than_the_budget(s3_options):
    """The whole-object GET is a range ending at max_sample_bytes + 1: an object of 3 GiB costs
    1 MiB + 1 byte of transfer and memory before it fails, not 3 GiB."""
    import asyncio

    pytest.importorskip("obstore")
    from asyncload.io import object_store
    from asyncload.io.limits import SampleTooLarge
    from tests.conftest import make_bucket, setup_s3fs

    with setup_s3fs(s3_options) as fs:
        make_bucket(fs)
        fs.pipe_file("asyncload-test/sizes/big.bin", b"x" * (2 << 20))

    async def read():
        fs = object_store.filesystem("s3", s3_options, loop=asyncio.get_running_loop(), read_timeout=10)
        store = fs._construct_store("asyncload-test")
        asked = []

        class Spy:
            def __getattr__(self, name):
                return getattr(store, name)

            async def get_range_async(self, key, start, end):
                result = await store.get_range_async(key, start=start, end=end)
                asked.append((start, end, len(result.to_bytes())))
                return result

        fs._construct_store = lambda bucket: Spy()
        with pytest.raises(SampleTooLarge, match="is 2097152 bytes"):
            await object_store.cat(fs, "asyncload-test/sizes/big.bin", limit=1 << 20)
        return asked

    assert asyncio.run(read()) == [(0, (1 << 20) + 1, (1 << 20) + 1)]


def test_s3fs_reads_an_object_no_further_than_the_budget(s3_options):
    import asyncio

    from asyncload.io import object_store
    from asyncload.io.limits import SampleTooLarge
    from asyncload.io.reader import one_request_read
    from tests.conftest import make_bucket, setup_s3fs

    with setup_s3fs(s3_options) as fs:
        make_bucket(fs)
        fs.pipe_file("asyncload-test/sizes/big.bin", b"x" * (2 << 20))

    async def read():
        fs = object_store.filesystem("s3", {**s3_options, "client": "fsspec"}, loop=asyncio.get_running_loop(),
                                     read_timeout=10)
        asked = []
        cat_file = fs._cat_file
        cat = one_request_read(fs, 1 << 20)  # bounded_cat, which calls fs._cat_file when it runs

        async def spy(path, start=None, end=None, **kwargs):
            data = await cat_file(path, start=start, end=end, **kwargs)
            asked.append((start, end, len(data)))
            return data

        fs._cat_file = spy
        try:
            with pytest.raises(SampleTooLarge, match="is 2097152 bytes"):
                await cat("asyncload-test/sizes/big.bin")
        finally:
            await object_store.close_sessions(fs)
        return asked

    assert asyncio.run(read()) == [(0, (1 << 20) + 1, (1 << 20) + 1)]
