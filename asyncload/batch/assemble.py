"""The hand-out of a batch whose layout has more than fixed fields (``batch/ragged.py``).

Each leaf of the sample becomes, in row order: a ``[B, *shape]`` tensor (fixed), a jagged
``torch.nested`` tensor (ragged: ``unbind()`` gives each row's values), a list of tensors
(list) or a list of Python values (object). The batch takes the run's layout (``target``), which
may have grown since its buffer was taken: a leaf fixed in the buffer but ragged in the run is
delivered ragged, so every batch after the change looks alike.

``storage`` are the buffer's fields, first ``size`` rows: tracked views of host memory, or
their copies on the GPU (the device stage copies them on its side stream, the ragged values
with the rest). A jagged leaf's values are then gathered into one tensor, on that device, by one
index (no Python per row), unless a row went aside (longer than its slot): then by rows.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from .layout import Leaf, SampleLayout, torch_dtype
from .ragged import fixed_leaves


def assemble(buffer: Any, storage: list[torch.Tensor], size: int, target: SampleLayout,
             device: torch.device | None = None) -> list[Any]:
    """The leaves of ``buffer``'s first ``size`` rows as ``target`` has them (see the module)."""
    have = buffer.layout.leaves if buffer.layout.leaves is not None else fixed_leaves(buffer.layout)
    want = target.leaves if target.leaves is not None else fixed_leaves(target)
    side = buffer.side
    out: list[Any] = []
    for number, (old, new) in enumerate(zip(have, want)):
        aside = {row: side[row, number] for row in range(size) if (row, number) in side} if side else {}
        if new.kind == "object":
            out.append(every_row(aside, size, f"leaf {number}"))
        elif new.kind == "fixed":
            out.append(storage[old.storage])
        else:
            rows = _rows(old, storage, buffer, size, aside, new, device)
            out.append(rows if new.kind == "list" else _jagged(old, storage, buffer, size, aside, new, rows, device))
    return out


def every_row(aside: dict[int, Any], size: int, leaf: str) -> list[Any]:
    """The values of a leaf that lives aside (an object or a list leaf), one per row: every row
    wrote one, so a missing one is a bug in the pipeline, not a ``None`` caption."""
    missing = [row for row in range(size) if row not in aside]
    assert not missing, f"rows {missing[:8]} have no value aside for {leaf}: the batch lost them"
    return [aside[row] for row in range(size)]


def host_part(buffer: Any, size: int) -> SimpleNamespace:
    """What ``assemble`` reads from a buffer on the host besides its storage (the layout, what
    went aside, each ragged row's length, each list row's shape), copied: with a device stage the buffer may be reused
    once its copy is done, before the batch is handed out."""
    shapes = {leaf.storage + 2 for leaf in buffer.layout.leaves or () if leaf.kind == "list" and leaf.storage >= 0}
    arrays = [np.array(array[:size]) if array is not None and (array.ndim == 1 or index in shapes) else None
              for index, array in enumerate(buffer.arrays)]
    return SimpleNamespace(layout=buffer.layout, side=dict(buffer.side), arrays=arrays)


def _tensor(value: Any, leaf: Leaf, device: torch.device | None) -> torch.Tensor:
    assert leaf.dtype is not None
    tensor = torch.from_numpy(np.ascontiguousarray(value)).to(torch_dtype(leaf.dtype))
    return tensor if device is None else tensor.to(device, non_blocking=True)


def _lengths(old: Leaf, buffer: Any, size: int) -> np.ndarray:
    """Each row's length in a ragged field (-1: the row went aside), from the host's buffer."""
    return np.asarray(buffer.arrays[old.storage + 1][:size], dtype=np.int64)


def _rows(old: Leaf, storage: list[torch.Tensor], buffer: Any, size: int, aside: dict[int, Any], new: Leaf,
          device: torch.device | None) -> list[torch.Tensor] | None:
    """Each row's tensor (a view where it is in the buffer); None where a jagged leaf needs no
    rows one by one (nothing aside: ``_jagged`` gathers them at once)."""
    if new.kind == "ragged" and not aside:
        return None
    if old.kind == "fixed":
        values = storage[old.storage]
        return [_tensor(aside[row], new, device) if row in aside else values[row] for row in range(size)]
    if old.kind == "ragged":
        values, lengths = storage[old.storage], _lengths(old, buffer, size)
        return [_tensor(aside[row], new, device) if row in aside else values[row, : lengths[row]]
                for row in range(size)]
    if old.storage >= 0:  # a list leaf in the buffer: each row's values, flat, and its shape
        values, lengths = storage[old.storage], _lengths(old, buffer, size)
        shapes = buffer.arrays[old.storage + 2][:size].tolist()
        return [_tensor(aside[row], new, device) if row in aside else values[row, : lengths[row]].view(shapes[row])
                for row in range(size)]
    return [_tensor(value, new, device) for value in every_row(aside, size, "a list leaf")]


def _jagged(old: Leaf, storage: list[torch.Tensor], buffer: Any, size: int, aside: dict[int, Any], new: Leaf,
            rows: list[torch.Tensor] | None, device: torch.device | None) -> torch.Tensor:
    """A jagged nested tensor of the rows (``nested_tensor_from_jagged``)."""
    if rows is not None:  # some went aside
        lengths = np.array([len(row) for row in rows], dtype=np.int64)
        values = torch.cat([row.reshape(-1, *new.shape) for row in rows]) if rows else None
    elif old.kind == "fixed":  # the batch's buffer is older than the field's turn: equal lengths
        whole = storage[old.storage]
        lengths = np.full(size, whole.shape[1] if whole.dim() > 1 else 0, dtype=np.int64)
        values = whole.reshape(-1, *new.shape)
    else:
        slots, lengths = storage[old.storage], _lengths(old, buffer, size)
        cap = slots.shape[1]
        starts = np.arange(size, dtype=np.int64) * cap
        index = np.repeat(starts - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths) + np.arange(lengths.sum())
        flat = slots.reshape(size * cap, *new.shape)
        values = flat.index_select(0, torch.from_numpy(index).to(flat.device, non_blocking=True))
    offsets = torch.from_numpy(np.concatenate(([0], np.cumsum(lengths))))
    if values is None:
        values = torch.empty((0, *new.shape), dtype=torch_dtype(new.dtype), device=device)  # type: ignore[arg-type]
    return torch.nested.nested_tensor_from_jagged(values, offsets.to(values.device))
