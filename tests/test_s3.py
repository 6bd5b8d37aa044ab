"""End to end against a real S3 server (SeaweedFS) on 127.0.0.1, through the default client."""

import pytest
import torch

from asyncload import AsyncLoader, ImageDecoder, SampleError, image_folder
from bench.s3server import LatencyProxy, storage_options
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
    """24 objects behind 0.2 s of latency each: one after the other would take 4.8 s."""
    import time

    with LatencyProxy(s3_server.port, (0.2, 0.2)) as proxy:
        options = storage_options(proxy.endpoint_url)
        source = image_folder(s3_jpeg_bucket, storage_options=s3_options)
        started = time.monotonic()
        with AsyncLoader(source, batch_size=24, storage_options=options, decode=ImageDecoder(16)) as loader:
            (images, labels), = list(loader)
        elapsed = time.monotonic() - started
    assert len(labels) == 24
    assert elapsed < 2.0


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
