"""Preallocated batch buffers, written in place row by row, and the ring that recycles them.

There is no collate step: once the layout of one sample is known, a batch is a set of tensors
(one per field) and each decode thread writes its sample into row ``i``. Buffers are reused
because a fresh 150 MB allocation costs tens of milliseconds of page faults on first touch,
and pinning (cudaHostAlloc) costs more. A buffer handed to the user goes back into use only
when nothing outside the ring references its memory any more and, for pinned memory, once the
GPU has passed every copy the user queued from it (see ``BatchBuffer.released``). A field a
batched GPU decoder writes lives on the GPU instead (``OnDevice``): the device stage clones it, so
no view of it ever reaches the user, and it is reused once that clone has run.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .layout import Field, SampleLayout, torch_dtype
from .ragged import write_any


@dataclass(frozen=True)
class OnDevice:
    """Fields of a batch that live on a CUDA device rather than in host memory (the image field of
    a batched GPU decoder), and the stream that writes them. They are allocated on that stream, so
    PyTorch's caching allocator reuses their memory only in that stream's order."""

    fields: frozenset[int]
    stream: Any  # torch.cuda.Stream


def hole_moves(size: int, holes: set[int]) -> tuple[list[tuple[int, int]], int]:
    """How ``close_holes`` makes the first ``size`` rows contiguous: ``(hole, row)`` pairs, row
    ``row`` copied into ``hole`` in that order, the first hole taking the last filled row; and how
    many rows are filled. One function, so that what rides beside the buffer (the strings of
    ``epoch/handout.py``) moves exactly as its rows do."""
    filled = [row for row in range(size) if row not in holes]
    moves = []
    for hole, row in zip(sorted(holes), reversed(filled)):
        if row < hole:
            break
        moves.append((hole, row))
    return moves, len(filled)


class BatchBuffer:
    """The tensors of one batch, ``[capacity, *field.shape]`` each, and NumPy views for writing rows.

    ``tensors`` takes memory allocated elsewhere (``processes=N`` puts every buffer in a shared
    memory segment that the parent process maps); by default each field is its own tensor.
    ``pinned``: the memory is page-locked (default: ``pin_memory``), so a copy to the GPU the
    user queues from it may still run after the user let go of it. ``on_device``: fields allocated
    on a CUDA device instead; they have no NumPy view (``arrays`` holds None for them) and go to
    the user only through the device stage, which waits on ``writes`` and clones them.

    What the user gets are views that can be tracked with public means only: each hand-out wraps
    a fresh NumPy view of the rows in a tensor (``torch.from_numpy``), whose storage holds that
    NumPy view until the last tensor, slice or array derived from it is gone; a weak reference
    to it tells when. (The storage use count would do as well but is a private torch API.)"""

    def __init__(
        self, layout: SampleLayout, capacity: int, pin_memory: bool = False, tensors: list[torch.Tensor] | None = None,
        pinned: bool | None = None, on_device: OnDevice | None = None,
    ) -> None:
        self.layout = layout
        self.capacity = capacity
        self.on_device = on_device
        if tensors is None:
            tensors = [self._allocate(index, f, pin_memory) for index, f in enumerate(layout.fields)]
        self.tensors = tensors
        self._arrays = [t.numpy() if t.device.type == "cpu" else None for t in self.tensors]
        self.writes: list[Any] = []  # CUDA events after which the device fields hold their rows
        self.pinned = pin_memory if pinned is None else pinned
        self.in_pipeline = False  # taken by the pipeline and not yet handed out or given back
        self.poisoned = False  # a stuck decode_into may write it whenever it returns: never free again
        self.slot = -1  # its ring's name for it: what a fill names (a shared segment's number)
        self.copy_done: Any = None  # a CUDA event: the GPU's reads of the buffer end before it
        self._handed: list[weakref.ref] = []  # the NumPy views under the tensors the user got
        self._with_user = False  # handed out pinned, and the user has not moved on yet
        self.side: dict[tuple[int, int], Any] = {}  # (row, leaf) -> a value not in the arrays (batch/ragged.py)
        self.crosses = False  # a child's view of a shared segment: what goes aside must pickle (batch/crossing.py)

    def _allocate(self, index: int, field: Field, pin_memory: bool) -> torch.Tensor:
        shape, dtype = (self.capacity, *field.shape), torch_dtype(field.dtype)
        if self.on_device is None or index not in self.on_device.fields:
            return torch.empty(shape, dtype=dtype, pin_memory=pin_memory)
        stream = self.on_device.stream
        with torch.cuda.stream(stream):
            return torch.empty(shape, dtype=dtype, device=stream.device)

    @property
    def arrays(self) -> list[np.ndarray | None]:
        """Writable NumPy views of every host field, ``[capacity, *shape]``: row ``i`` is
        ``array[i]``; None for a field on a CUDA device (``on_device``)."""
        return self._arrays

    def rows(self, index: int) -> list[np.ndarray]:
        """Writable views of row ``index`` of every field."""
        return [array[index, ...] for array in self._arrays]  # `...` keeps 0-d rows as views

    def write(self, index: int, sample: Any) -> None:
        """Copies a decoded sample into row ``index`` (NumPy releases the GIL for the copy). A
        sample that is not fixed-shape arrays of the layout's shapes is ``write_any``'s."""
        arrays = self.layout.flatten(sample)
        if arrays is None:
            write_any(self, index, sample)
            return
        for row, array in zip(self.rows(index), arrays):
            np.copyto(row, array, casting="same_kind")

    def close_holes(self, size: int, holes: set[int]) -> int:
        """Moves the last filled rows into the empty rows ``holes`` (skipped samples the epoch
        had no replacement for, see ``hole_moves``); returns how many rows are filled."""
        moves, filled = hole_moves(size, holes)
        for hole, row in moves:
            for array in self._arrays:
                if array is not None:
                    array[hole] = array[row]
        if self.side:  # what rides aside moves with its row (batch/ragged.py)
            to = {row: hole for hole, row in moves}
            self.side = {(to.get(row, row), leaf): value for (row, leaf), value in self.side.items() if row not in holes}
        if moves and self.on_device is not None:  # on the stream that wrote them, so after their writes
            with torch.cuda.stream(self.on_device.stream):
                for tensor in (self.tensors[index] for index in self.on_device.fields):
                    for hole, row in moves:
                        tensor[hole].copy_(tensor[row])
                self.writes.append(torch.cuda.Event())  # one more write for the device stage to wait on
                self.writes[-1].record()
        return filled

    def views(self, size: int) -> list[torch.Tensor]:
        """The first ``size`` rows of every field, as tensors the ring tracks (see the class
        docstring): the only way rows may leave the pipeline for the user."""
        arrays = [array[:size] for array in self._arrays]
        self._handed = [weakref.ref(array) for array in arrays]
        self._with_user = self.pinned
        self.in_pipeline = False
        return [torch.from_numpy(array) for array in arrays]

    def batch(self, size: int) -> Any:
        """The first ``size`` rows, structured like a sample (tracked views, see ``views``)."""
        return self.layout.unflatten(self.views(size))

    def released(self) -> None:
        """The user asked for the next batch (or ended the iteration): what they did with this
        one has been queued by now. For pinned memory a CUDA event on the current stream marks
        that point, and the buffer is reused only once the GPU has passed it, so a
        ``x.to("cuda", non_blocking=True)`` still queued reads the batch, not the next one (the
        rule PyTorch's caching host allocator keeps). Without CUDA in use, nothing can be queued."""
        if not self._with_user:
            return
        if torch.cuda.is_initialized():
            event = torch.cuda.Event()
            event.record()  # on the current stream: where the user's copies were queued
            self.copy_done = event
        self._with_user = False  # last: the ring (another thread) must not see it free before

    def give_back(self) -> None:
        """Returns a buffer the pipeline took but will not hand out (an epoch ended early)."""
        self.in_pipeline = False

    def gpu_done(self) -> bool:
        """True when no copy the GPU may still run reads the memory (ours or the user's)."""
        if self._with_user:
            return False
        if self.copy_done is not None:
            if not self.copy_done.query():
                return False
            self.copy_done = None
        return True

    def is_free(self) -> bool:
        """True when no view handed out is alive, the user has moved past a pinned batch, no
        device copy still reads the memory, and no abandoned decode may still write it."""
        if self.in_pipeline or self.poisoned or not self.gpu_done():
            return False
        return all(ref() is None for ref in self._handed)


class BufferRing:
    """Hands out batch buffers, reusing released ones, keeping at most ``keep`` spare.

    The pipeline bounds how many buffers it fills ahead (``prefetch``); the ring only decides
    whether a buffer can be recycled. A buffer the user still holds is never reused: if none is
    provably free, a fresh one is allocated.
    """

    def __init__(self, keep: int, pin_memory: bool) -> None:
        self.keep = keep
        self.pin_memory = pin_memory
        self.layout: SampleLayout | None = None
        self.capacity = 0
        self.on_device: OnDevice | None = None
        self._buffers: list[BatchBuffer] = []
        self._draining: list[BatchBuffer] = []  # forgotten, but the GPU may still read them
        self._lock = threading.Lock()
        self._slots = itertools.count()
        self._by_slot: weakref.WeakValueDictionary[int, BatchBuffer] = weakref.WeakValueDictionary()

    def configure(self, layout: SampleLayout, capacity: int, on_device: OnDevice | None = None) -> None:
        """Sets the sample layout (and the fields that live on a CUDA device); buffers of another
        layout are dropped."""
        with self._lock:
            if self.layout is not None and self.layout.key() == layout.key():
                if capacity == self.capacity and on_device == self.on_device:
                    return
            self.layout, self.capacity, self.on_device = layout, capacity, on_device
            self._buffers = []

    def take(self) -> BatchBuffer:
        """A buffer nobody uses: a released one if there is one, else a new one."""
        assert self.layout is not None, "configure() the ring first"
        with self._lock:
            for index, buffer in enumerate(self._buffers):
                if buffer.is_free():
                    del self._buffers[index]
                    break
            else:
                buffer = self._new_buffer()
            buffer.in_pipeline = True
            buffer.side = {}
            buffer.writes = []  # a batch given back uncopied left its own: later ones on that stream cover them
            self._buffers.append(buffer)  # most recently used goes last
            self._forget_held_buffers()
            return buffer

    def aside_values(self) -> list[tuple[int, Any]]:
        """``(leaf, value)`` for what the rows of this ring's buffers put aside (the batches
        lately filled): what children would have to send (``switch.py``)."""
        with self._lock:
            return [(leaf, value) for buffer in self._buffers for (_, leaf), value in list(buffer.side.items())]

    def _new_buffer(self) -> BatchBuffer:
        assert self.layout is not None
        buffer = BatchBuffer(self.layout, self.capacity, self.pin_memory, on_device=self.on_device)
        buffer.slot = next(self._slots)
        self._by_slot[buffer.slot] = buffer
        return buffer

    def buffer(self, slot: int) -> BatchBuffer:
        """The buffer a fill names (one the pipeline took: the driver holds it meanwhile)."""
        return self._by_slot[slot]

    def _forget_held_buffers(self) -> None:
        """Past ``keep`` buffers, stop tracking the oldest: the user owns them, memory goes when
        the user drops them."""
        excess = len(self._buffers) - self.keep
        if excess > 0:
            self._draining += [buffer for buffer in self._buffers[:excess] if not buffer.gpu_done()]
            del self._buffers[:excess]
        # Their memory must not go back to PyTorch's pinned allocator (which would hand it out
        # again at once) while a copy may still read it.
        self._draining = [buffer for buffer in self._draining if not buffer.gpu_done()]

    def clear(self) -> None:
        """Drops every buffer, once the GPU is done with them (see ``_forget_held_buffers``)."""
        with self._lock:
            for buffer in self._buffers + self._draining:
                if buffer.copy_done is not None:
                    buffer.copy_done.synchronize()
            self._buffers, self._draining = [], []
