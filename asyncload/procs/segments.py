"""The parent's ring of shared batch segments, mapped in every child.

The parent allocates every segment (``shm.py``), maps it, pins it for the GPU when the loader
has a CUDA device, and announces it to each child with its descriptor. A segment is reused once
``BatchBuffer.is_free`` says nothing holds it (no view handed to the user is alive, no device
copy reads it, no child may still write it), because a fresh 150 MB segment costs tens of
milliseconds of page faults on first touch. Free segments beyond ``keep`` are dropped here and
in the children; one the user still holds stays mapped until the user lets go of it.
"""

from __future__ import annotations

import itertools
import os
from typing import Callable

import torch

from ..batch.buffers import BatchBuffer
from ..batch.layout import SampleLayout
from . import shm
from .protocol import Map

Announce = Callable[[Map, int], None]  # sends a Map and its descriptor to every child
_rings = itertools.count()  # segment names tell rings apart: asyncload-<pid>-<ring>-<segment>


class SegmentRing:
    """Batch buffers in shared memory, by segment number."""

    def __init__(self, keep: int, device: torch.device | None, announce: Announce,
                 forget: Callable[[list[int]], None]) -> None:
        self.keep = keep
        self.device = device  # pinned for copies to it, when given (and only then)
        self.announce = announce
        self.forget = forget
        self.layout: SampleLayout | None = None
        self.capacity = 0
        self.segments: dict[int, BatchBuffer] = {}
        self._ids = itertools.count()
        self.name = f"asyncload-{os.getpid()}-{next(_rings)}"

    def configure(self, layout: SampleLayout, capacity: int) -> None:
        """Sets the layout; segments of another layout are dropped once free."""
        if self.layout is not None and (self.layout.key(), self.capacity) == (layout.key(), capacity):
            return
        self.layout, self.capacity = layout, capacity
        self._drop([i for i, buffer in self.segments.items() if buffer.is_free()])

    def take(self) -> BatchBuffer:
        """A free segment (marked in use by the pipeline), or a new one; ``number`` names it."""
        assert self.layout is not None, "configure() the ring first"
        self.sweep()
        for buffer in self.segments.values():
            if buffer.layout is self.layout and buffer.capacity == self.capacity and buffer.is_free():
                buffer.in_pipeline = True
                buffer.side = {}
                return buffer
        buffer = self._allocate(self.layout, self.capacity)
        buffer.in_pipeline = True
        return buffer

    def sweep(self) -> None:
        """Drops free segments beyond ``keep``, and free ones of an old layout."""
        free = [i for i, buffer in self.segments.items() if buffer.is_free()]
        stale = [i for i in free if self.segments[i].layout is not self.layout]
        excess = max(0, len(self.segments) - len(stale) - self.keep)
        self._drop(stale + [i for i in free if i not in stale][:excess])

    def _allocate(self, layout: SampleLayout, capacity: int) -> BatchBuffer:
        number = next(self._ids)
        _, size = shm.field_offsets(layout, capacity)
        fd = shm.create(f"{self.name}-{number}", size)
        try:
            buffer = shm.buffer_on(fd, layout, capacity)
            buffer.slot = number
            if self.device is not None:
                shm.pin(buffer, self.device)
            self.segments[number] = buffer
            self.announce(Map(number, layout, capacity), fd)
        finally:
            os.close(fd)
        return buffer

    def _drop(self, numbers: list[int]) -> None:
        if not numbers:
            return
        for number in numbers:
            buffer = self.segments.pop(number)
            if self.device is not None:
                shm.unpin(buffer, self.device)
        self.forget(numbers)
