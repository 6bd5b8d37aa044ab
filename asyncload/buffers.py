"""Preallocated batch buffers, written in place row by row, and the ring that recycles them.

There is no collate step: once the layout of one sample is known, a batch is a set of tensors
(one per field) and each decode thread writes its sample into row ``i``. Buffers are reused
because a fresh 150 MB allocation costs tens of milliseconds of page faults on first touch,
and pinning (cudaHostAlloc) costs more. A buffer handed to the user goes back into use only
when nothing outside the ring references its memory any more.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch


@dataclass(frozen=True)
class Field:
    """One array of a sample: its shape and dtype (the batch holds ``[B, *shape]``)."""

    shape: tuple[int, ...]
    dtype: np.dtype


class SampleLayout:
    """The structure of a sample (an array, or a tuple/list/dict of them, nested) and its fields.

    ``flatten`` turns a sample into its fields' arrays, in a fixed order; ``unflatten`` builds the
    same structure from the batch's tensors, so a tuple or dict sample gives a tuple or dict batch.
    """

    def __init__(self, tree: Any, fields: list[Field]) -> None:
        self.tree = tree
        self.fields = fields

    @classmethod
    def of(cls, sample: Any) -> "SampleLayout":
        arrays: list[np.ndarray] = []
        tree = _flatten(sample, arrays)
        return cls(tree, [Field(a.shape, a.dtype) for a in arrays])

    def flatten(self, sample: Any) -> list[np.ndarray]:
        arrays: list[np.ndarray] = []
        tree = _flatten(sample, arrays)
        if tree != self.tree:
            raise ValueError(f"sample structure {tree!r} differs from the first sample's {self.tree!r}")
        for array, field in zip(arrays, self.fields):
            if array.shape != field.shape:
                raise ValueError(f"sample field of shape {array.shape} differs from the first sample's {field.shape}")
        return arrays

    def unflatten(self, leaves: Sequence[Any]) -> Any:
        return _unflatten(self.tree, iter(leaves))


def _flatten(sample: Any, out: list[np.ndarray]) -> Any:
    """Appends the arrays of ``sample`` to ``out``; returns the structure, leaves as ``None``."""
    if isinstance(sample, dict):
        return {key: _flatten(value, out) for key, value in sample.items()}
    if isinstance(sample, (tuple, list)):
        return tuple(_flatten(value, out) for value in sample)
    if isinstance(sample, torch.Tensor):
        sample = sample.numpy()
    out.append(np.asarray(sample))
    return None


def _unflatten(tree: Any, leaves: Any) -> Any:
    if tree is None:
        return next(leaves)
    if isinstance(tree, dict):
        return {key: _unflatten(sub, leaves) for key, sub in tree.items()}
    return tuple(_unflatten(sub, leaves) for sub in tree)


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    try:
        return torch.from_numpy(np.empty(0, dtype=dtype)).dtype
    except TypeError as error:
        raise TypeError(f"a sample field of dtype {dtype} cannot go into a torch tensor") from error


def _storage_refs(tensor: torch.Tensor) -> int:
    """How many tensors share ``tensor``'s memory (views, slices, numpy arrays of them included)."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


class BatchBuffer:
    """The tensors of one batch, ``[capacity, *field.shape]`` each, and NumPy views for writing rows.

    ``tensors`` takes memory allocated elsewhere (``isolate=True`` puts every buffer in a shared
    memory segment that the parent process maps); by default each field is its own tensor."""

    def __init__(
        self, layout: SampleLayout, capacity: int, pin_memory: bool = False, tensors: list[torch.Tensor] | None = None
    ) -> None:
        self.layout = layout
        self.capacity = capacity
        if tensors is None:
            tensors = [
                torch.empty((capacity, *f.shape), dtype=_torch_dtype(f.dtype), pin_memory=pin_memory)
                for f in layout.fields
            ]
        self.tensors = tensors
        self._arrays = [t.numpy() for t in self.tensors]
        self._baseline = [_storage_refs(t) for t in self.tensors]
        self.in_pipeline = False  # taken by the pipeline and not yet handed out or given back
        self.copy_done: Any = None  # a CUDA event: the buffer's device copy must finish before reuse

    @property
    def arrays(self) -> list[np.ndarray]:
        """Writable NumPy views of every field, ``[capacity, *shape]``: row ``i`` is ``array[i]``."""
        return self._arrays

    def rows(self, index: int) -> list[np.ndarray]:
        """Writable views of row ``index`` of every field."""
        return [array[index, ...] for array in self._arrays]  # `...` keeps 0-d rows as views

    def write(self, index: int, sample: Any) -> None:
        """Copies a decoded sample into row ``index`` (NumPy releases the GIL for the copy)."""
        for row, array in zip(self.rows(index), self.layout.flatten(sample)):
            np.copyto(row, array, casting="same_kind")

    def close_holes(self, size: int, holes: set[int]) -> int:
        """Moves the last filled rows into the empty rows ``holes`` (skipped samples the epoch
        had no replacement for); returns how many rows are filled."""
        filled = [row for row in range(size) if row not in holes]
        for hole, row in zip(sorted(holes), reversed(filled)):
            if row < hole:
                break
            for array in self._arrays:
                array[hole] = array[row]
        return len(filled)

    def batch(self, size: int) -> Any:
        """The first ``size`` rows, structured like a sample. These are new tensor views, so the
        ring can tell when the user has let go of them."""
        views = [t[:size] for t in self.tensors]
        self.in_pipeline = False
        return self.layout.unflatten(views)

    def give_back(self) -> None:
        """Returns a buffer the pipeline took but will not hand out (an epoch ended early)."""
        self.in_pipeline = False

    def is_free(self) -> bool:
        """True when no view handed out is alive and no device copy still reads the memory."""
        if self.in_pipeline:
            return False
        if self.copy_done is not None and not self.copy_done.query():
            return False
        return all(_storage_refs(t) <= base for t, base in zip(self.tensors, self._baseline))


Allocator = Callable[[SampleLayout, int], BatchBuffer]


class BufferRing:
    """Hands out batch buffers, reusing released ones, keeping at most ``keep`` spare.

    The pipeline bounds how many buffers it fills ahead (``prefetch``); the ring only decides
    whether a buffer can be recycled. A buffer the user still holds is never reused: if none is
    provably free, a fresh one is allocated, by ``allocate(layout, capacity)`` when given (the
    hook ``isolate.py`` uses for shared memory).
    """

    def __init__(self, keep: int, pin_memory: bool, allocate: Allocator | None = None) -> None:
        self.keep = keep
        self.pin_memory = pin_memory
        self.allocate = allocate
        self.layout: SampleLayout | None = None
        self.capacity = 0
        self._buffers: list[BatchBuffer] = []
        self._lock = threading.Lock()

    def configure(self, layout: SampleLayout, capacity: int) -> None:
        """Sets the sample layout; buffers of another layout are dropped."""
        with self._lock:
            if self.layout is not None and (self.layout.tree, self.layout.fields) == (layout.tree, layout.fields):
                if capacity == self.capacity:
                    return
            self.layout, self.capacity = layout, capacity
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
            self._buffers.append(buffer)  # most recently used goes last
            self._forget_held_buffers()
            return buffer

    def _new_buffer(self) -> BatchBuffer:
        assert self.layout is not None
        if self.allocate is not None:
            return self.allocate(self.layout, self.capacity)
        return BatchBuffer(self.layout, self.capacity, self.pin_memory)

    def _forget_held_buffers(self) -> None:
        """Past ``keep`` buffers, stop tracking the oldest: the user owns them, memory goes when
        the user drops them."""
        excess = len(self._buffers) - self.keep
        if excess > 0:
            del self._buffers[:excess]

    def clear(self) -> None:
        with self._lock:
            self._buffers = []
