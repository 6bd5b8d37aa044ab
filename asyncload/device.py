"""The device stage: batch k+1 goes host->GPU on a side CUDA stream while the user's step runs
on batch k.

The consumer's stream waits on an event, never the host; the pinned buffer is recycled only
after its copy's event has completed. Fields a GPU decoder wrote on the device are cloned there
instead of copied up. GPU tensors come from PyTorch's caching allocator and
are marked with ``record_stream`` so their memory is not reused while the user's stream still
works on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .batch.buffers import BatchBuffer
from .batch.ragged import used_parts


def resolve_device(device: str | torch.device | None) -> torch.device | None:
    """The CUDA device to copy batches to, or None to stay on the CPU. A CUDA device without
    CUDA fails here, at construction, rather than at the first batch."""
    if device is None:
        return None
    device = torch.device(device)
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        raise ValueError(f"device must be None, 'cpu' or a CUDA device, got {device}")
    if not torch.cuda.is_available():
        raise RuntimeError(f"device={str(device)!r} was asked for, but torch.cuda.is_available() is False")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def is_image_batch(tensor: torch.Tensor) -> bool:
    """uint8 [B, H, W, C] with C in (1, 3, 4): what ``normalize`` converts."""
    return tensor.dtype == torch.uint8 and tensor.dim() == 4 and tensor.shape[-1] in (1, 3, 4)


def normalize_images(
    images: torch.Tensor, mean: Sequence[float] | torch.Tensor, std: Sequence[float] | torch.Tensor
) -> torch.Tensor:
    """uint8 NHWC -> float32 NCHW, scaled to [0, 1], then ``(x - mean) / std`` per channel (as
    torchvision's ToTensor + Normalize). The result keeps channels-last strides, which
    convolutions on the GPU prefer. ``mean``/``std`` already on the images' device cost no copy
    (see ``Normalize``)."""
    mean_t = torch.as_tensor(mean, dtype=torch.float32, device=images.device).view(1, -1, 1, 1)
    std_t = torch.as_tensor(std, dtype=torch.float32, device=images.device).view(1, -1, 1, 1)
    floats = images.permute(0, 3, 1, 2).to(torch.float32).div_(255.0)
    return floats.sub_(mean_t).div_(std_t)


class Normalize:
    """``normalize_images`` with its mean and std built once on ``device``. Built per batch from
    Python lists on the side stream, they were a small pageable host->device copy queued behind
    the batch's copy, which the host waited for: the whole copy's time at every ``start_copy``."""

    def __init__(self, mean: Sequence[float], std: Sequence[float], device: torch.device | None = None) -> None:
        self.mean = torch.tensor(mean, dtype=torch.float32, device=device)
        self.std = torch.tensor(std, dtype=torch.float32, device=device)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        return normalize_images(images, self.mean, self.std)


def convert_batch(leaves: list[torch.Tensor], normalize: tuple[Sequence[float], Sequence[float]] | Normalize | None
                  ) -> list[torch.Tensor]:
    if normalize is None:
        return leaves
    convert = normalize if isinstance(normalize, Normalize) else Normalize(*normalize)
    return [convert(t) if is_image_batch(t) else t for t in leaves]


def normalize_fixed(leaves: list[Any], normalize: tuple[Sequence[float], Sequence[float]] | Normalize | None
                    ) -> list[Any]:
    """``convert_batch`` on an assembled batch's leaves (``batch/assemble.py``): only its fixed
    fields' tensors, never a jagged tensor or a list of them (a ragged uint8 field's storage
    ``[B, cap, W, C]`` looks like an image batch, but is not one). The one rule of both the host
    and the device hand-out for batches with more than fixed fields."""
    if normalize is None:
        return leaves
    convert = normalize if isinstance(normalize, Normalize) else Normalize(*normalize)
    return [convert(leaf) if isinstance(leaf, torch.Tensor) and not leaf.is_nested and is_image_batch(leaf) else leaf
            for leaf in leaves]


def copy_rows(buffer: BatchBuffer, size: int, device: torch.device, normalize: Normalize | None,
              stream: Any = None) -> list[torch.Tensor]:
    """The first ``size`` rows of ``buffer``'s fields on ``device`` (a ragged field's used part,
    ``used_parts``), issued on the current stream; a batch of fixed fields also normalized here.
    Fields already on the device are cloned (``stream``: the one that reads them)."""
    leaves = []
    for tensor, part in zip(buffer.tensors, used_parts(buffer, size)):
        if tensor.is_cuda:
            tensor.record_stream(stream)  # its memory outlives this clone's reads
            leaves.append(part.clone())
        else:
            leaves.append(part.to(device, non_blocking=True))
    if buffer.layout.leaves is None:  # else normalize_fixed, once assembled
        leaves = convert_batch(leaves, normalize)
    return leaves


@dataclass
class PendingCopy:
    """A batch whose copy to the GPU has been issued on the side stream."""

    leaves: list[torch.Tensor]
    done: Any  # torch.cuda.Event


class DeviceStage:
    """Issues host->device copies on a side stream and hands the results to the user's stream."""

    def __init__(self, device: torch.device, normalize: tuple[Sequence[float], Sequence[float]] | None) -> None:
        self.device = device
        self.normalize = Normalize(*normalize, device=device) if normalize is not None else None
        self.stream = torch.cuda.Stream(device)

    def start_copy(self, buffer: BatchBuffer, size: int) -> PendingCopy:
        """Copies the first ``size`` rows of ``buffer`` asynchronously; the buffer stays out of
        the ring until the copy's event completes.

        Fields already on the device (a GPU decoder's images) are cloned after the decoder's
        events, a device-to-device copy: the user never holds the decode buffer, so it is
        recycled by the same rule as a host one (once ``copy_done`` has completed)."""
        writes, buffer.writes = buffer.writes, []
        with torch.cuda.stream(self.stream):
            for event in writes:
                self.stream.wait_event(event)
            leaves = copy_rows(buffer, size, self.device, self.normalize, self.stream)
            done = torch.cuda.Event()
            done.record(self.stream)
        # The event first, the release last: the ring (on the loop thread) may look at the buffer
        # at any moment, and without its event it would take it as free while the copy reads it.
        buffer.copy_done = done
        buffer.in_pipeline = False
        return PendingCopy(leaves, done)

    def hand_over(self, pending: PendingCopy) -> list[torch.Tensor]:
        """Makes the user's current stream wait for the copy (on the GPU, not the host)."""
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(pending.done)
        for tensor in pending.leaves:
            tensor.record_stream(consumer)
        return pending.leaves
