import time

import numpy as np
import pytest
import torch

from asyncload import AsyncLoader, ImageDecoder, image_folder
from asyncload.device import is_image_batch, normalize_images, resolve_device

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_cpu_or_none_means_no_device_stage():
    assert resolve_device(None) is None and resolve_device("cpu") is None


def test_other_devices_are_rejected():
    with pytest.raises(ValueError, match="CUDA device"):
        resolve_device("meta")


def test_normalize_images_matches_totensor_and_normalize():
    images = torch.randint(0, 256, (2, 4, 5, 3), dtype=torch.uint8)
    out = normalize_images(images, (0.1, 0.2, 0.3), (0.5, 0.6, 0.7))
    assert out.shape == (2, 3, 4, 5) and out.dtype == torch.float32
    expected = (images.permute(0, 3, 1, 2).float() / 255 - torch.tensor([0.1, 0.2, 0.3]).view(1, 3, 1, 1)) / torch.tensor(
        [0.5, 0.6, 0.7]
    ).view(1, 3, 1, 1)
    torch.testing.assert_close(out, expected)


def test_only_uint8_nhwc_fields_are_images():
    assert is_image_batch(torch.zeros(2, 8, 8, 3, dtype=torch.uint8))
    assert not is_image_batch(torch.zeros(2, dtype=torch.int64))
    assert not is_image_batch(torch.zeros(2, 3, 8, 8, dtype=torch.uint8))


@cuda
def test_batches_arrive_on_the_gpu_equal_to_the_cpu_ones(jpeg_folder):
    source = image_folder(str(jpeg_folder))
    kwargs = dict(batch_size=5, seed=1, decode=ImageDecoder(32, train=True))
    with AsyncLoader(source, **kwargs) as cpu, AsyncLoader(source, device="cuda", **kwargs) as gpu:
        cpu_batches = [(i.clone(), l.clone()) for i, l in cpu]
        on_gpu = list(gpu)  # one epoch: iterating `gpu` again would run (and count) a second one
        assert all(i.is_cuda and l.is_cuda for i, l in on_gpu)
        gpu_batches = [(i.cpu(), l.cpu()) for i, l in on_gpu]
    assert len(cpu_batches) == len(gpu_batches)
    assert gpu.stats.stages["copy"].items == len(gpu_batches)
    for (ci, cl), (gi, gl) in zip(cpu_batches, gpu_batches):
        assert torch.equal(ci, gi) and torch.equal(cl, gl)


@cuda
def test_host_buffers_are_pinned(jpeg_folder):
    with AsyncLoader(image_folder(str(jpeg_folder)), batch_size=4, decode=ImageDecoder(16)) as loader:
        images, _ = next(iter(loader))
        assert images.is_pinned()


@cuda
def test_gpu_normalize(jpeg_folder):
    source = image_folder(str(jpeg_folder))
    norm = ((0.5, 0.5, 0.5), (0.2, 0.2, 0.2))
    with AsyncLoader(source, batch_size=4, shuffle=False, decode=ImageDecoder(16)) as cpu, \
         AsyncLoader(source, batch_size=4, shuffle=False, decode=ImageDecoder(16), device="cuda", normalize=norm) as gpu:
        raw, _ = next(iter(cpu))
        floats, _ = next(iter(gpu))
    assert floats.is_cuda and floats.shape == (4, 3, 16, 16)
    torch.testing.assert_close(floats.cpu(), normalize_images(raw, *norm))


@cuda
def test_kept_gpu_batches_stay_intact():
    with AsyncLoader(list(range(64)), batch_size=4, shuffle=False, read=False, device="cuda",
                     decode=lambda i: np.full((256,), i, np.int64)) as loader:
        batches = list(loader)
    torch.cuda.synchronize()
    for k, batch in enumerate(batches):
        assert batch[:, 0].tolist() == list(range(4 * k, 4 * k + 4))


@cuda
def test_user_copies_from_pinned_batches_are_not_overwritten():
    """device=None with CUDA: batches are pinned, and the usual ``x.to("cuda", non_blocking=True)``
    queues a copy that runs later. With the GPU kept busy, each copy runs after the user dropped
    the batch and the loader went on: the buffer must not hold the next batch's values by then."""
    batches, size, width = 24, 4, 1 << 18
    with AsyncLoader(list(range(batches * size)), batch_size=size, shuffle=False, read=False, prefetch=2,
                     decode=lambda i: np.full((width,), i, np.int64)) as loader:
        on_gpu = []
        for batch in loader:
            assert batch.is_pinned()
            torch.cuda._sleep(20_000_000)  # tens of ms of GPU work ahead of the copy
            on_gpu.append(batch.to("cuda", non_blocking=True))
            del batch
        torch.cuda.synchronize()
    for k, batch in enumerate(on_gpu):
        expected = torch.arange(k * size, k * size + size, device="cuda").view(-1, 1).expand(-1, width)
        assert torch.equal(batch, expected), f"batch {k} holds other values"


@cuda
def test_pinned_buffers_are_still_reused_once_the_gpu_is_done():
    """The event rule must not stop recycling: with the GPU idle, the ring reuses its buffers."""
    with AsyncLoader(list(range(400)), batch_size=4, shuffle=False, read=False, prefetch=2,
                     decode=lambda i: np.full((16,), i, np.int64)) as loader:
        pointers = set()
        for batch in loader:
            pointers.add(batch.data_ptr())
            batch.to("cuda", non_blocking=True)
            torch.cuda.synchronize()
            del batch
    assert len(pointers) <= loader._backend.ring.keep + 2


@cuda
def test_start_copy_with_normalize_does_not_wait_for_the_gpu():
    """Issuing a batch's copy returns at once, normalize or not: nothing in it waits for the
    side stream (here kept busy for about 0.1 s) to finish the copy."""
    from asyncload.batch.buffers import BatchBuffer
    from asyncload.batch.layout import SampleLayout
    from asyncload.device import DeviceStage

    stage = DeviceStage(torch.device("cuda", torch.cuda.current_device()), ((0.5, 0.4, 0.3), (0.2, 0.2, 0.2)))
    buffer = BatchBuffer(SampleLayout.of(np.zeros((64, 64, 3), np.uint8)), 8, pin_memory=True)
    buffer.tensors[0].fill_(51)
    stage.hand_over(stage.start_copy(buffer, 8))  # once first: kernels load lazily at their first launch
    torch.cuda.synchronize()
    with torch.cuda.stream(stage.stream):
        torch.cuda._sleep(200_000_000)
    started = time.perf_counter()
    pending = stage.start_copy(buffer, 8)
    issued = time.perf_counter() - started
    (floats,) = stage.hand_over(pending)
    torch.cuda.synchronize()
    assert issued < 0.03, f"start_copy blocked the host for {issued * 1000:.1f} ms"
    expected = (torch.full((8, 3, 64, 64), 0.2) - torch.tensor([0.5, 0.4, 0.3]).view(1, 3, 1, 1)) / 0.2
    torch.testing.assert_close(floats.cpu(), expected)
