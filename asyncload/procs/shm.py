"""Shared-memory batch buffers for ``processes=N``: one anonymous segment per buffer.

A segment is a ``memfd`` (an anonymous file in RAM, Linux >= 3.17): it never has a name in
``/dev/shm``, so there is nothing to unlink and nothing for Python's ``resource_tracker`` to
track or warn about, and the kernel frees it once the last mapping is gone, whoever dies first
and however. The parent creates it, maps it, and passes its descriptor to every child over its
pipe (``SCM_RIGHTS``); each process maps it once through PyTorch's own file mapping and closes its
descriptor at once, so a thousand batches kept by the user cost no file descriptors. Every field
of the batch is a tensor view into the segment's one storage; ``BatchBuffer.is_free`` tells from
the views it handed out whether anything still holds a batch.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

from ..batch.buffers import BatchBuffer
from ..batch.layout import SampleLayout, torch_dtype

ALIGN = 64  # field offsets: cache lines, and any dtype's alignment


def supported() -> str | None:
    """None where segments work here, else why not."""
    if not hasattr(os, "memfd_create"):
        return f"processes= needs Linux (os.memfd_create); this is {sys.platform}"
    if not os.path.isdir("/proc/self/fd"):
        return "processes= needs /proc to map shared memory"
    return None


def field_offsets(layout: SampleLayout, capacity: int) -> tuple[list[int], int]:
    """Where each field's ``[capacity, *shape]`` array starts in the segment, and its size."""
    offsets, end = [], 0
    for field in layout.fields:
        end = -(-end // ALIGN) * ALIGN
        offsets.append(end)
        end += capacity * int(np.prod(field.shape, dtype=np.int64)) * field.dtype.itemsize
    return offsets, max(end, 1)


def create(name: str, nbytes: int) -> int:
    """A new anonymous segment of ``nbytes`` zero bytes; returns its descriptor (close it once
    it has been mapped and, by the child, sent)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise
    return fd


def buffer_on(fd: int, layout: SampleLayout, capacity: int) -> BatchBuffer:
    """Maps segment ``fd`` (it may be closed afterwards) as a batch buffer of ``layout``. The
    mapping lives as long as any tensor view of it."""
    return BatchBuffer(layout, capacity, tensors=_field_views(fd, layout, capacity))


def _field_views(fd: int, layout: SampleLayout, capacity: int) -> list[torch.Tensor]:
    """The fields as views of one storage (no other reference to it outlives this function)."""
    offsets, size = field_offsets(layout, capacity)
    storage = torch.UntypedStorage.from_file(f"/proc/self/fd/{fd}", True, size)
    whole = torch.empty(0, dtype=torch.uint8).set_(storage)
    views = []
    for field, offset in zip(layout.fields, offsets):
        length = capacity * int(np.prod(field.shape, dtype=np.int64)) * field.dtype.itemsize
        views.append(whole[offset : offset + length].view(torch_dtype(field.dtype)).view(capacity, *field.shape))
    return views


def address(buffer: BatchBuffer) -> int:
    """The segment's start: the one storage under every field of ``buffer``."""
    return buffer.tensors[0].untyped_storage().data_ptr()


def nbytes(buffer: BatchBuffer) -> int:
    return buffer.tensors[0].untyped_storage().nbytes()


def pin(buffer: BatchBuffer, device: torch.device) -> None:
    """Page-locks the segment for fast, asynchronous copies to ``device`` (cudaHostRegister: the
    memory is already there, so it cannot be allocated pinned as the in-process ring does).
    Under a guard of ``device``: registering on whatever device is current would create a
    context on cuda:0 for a loader that copies to cuda:1."""
    with torch.cuda.device(device):
        error = torch.cuda.cudart().cudaHostRegister(address(buffer), nbytes(buffer), 0)
    if int(error) != 0:
        raise RuntimeError(f"cudaHostRegister of a {nbytes(buffer)}-byte batch buffer failed: {error}")


def unpin(buffer: BatchBuffer, device: torch.device) -> None:
    """Undoes ``pin``; must come before the segment is unmapped. Waits for a device copy that
    still reads the buffer."""
    if buffer.copy_done is not None:
        buffer.copy_done.synchronize()
    with torch.cuda.device(device):
        torch.cuda.cudart().cudaHostUnregister(address(buffer))
