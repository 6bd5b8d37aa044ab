"""What one sample looks like: its fields (an array's shape and dtype each) and their structure.

The first sample that loads teaches the layout; every buffer of the run is allocated from it,
every later sample is checked against it, and the batch handed out has the sample's structure
(a tuple or dict sample gives a tuple or dict batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

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

    Why not ``torch.utils._pytree``: ``flatten`` runs once per sample for decoders without
    ``decode_into``, and on torch 2.13 ``tree_leaves`` alone costs what this whole walk and its
    checks cost (about 1.9 us), ``tree_flatten`` twice that; and a pickled ``TreeSpec`` (layouts go
    to child processes) warns (FutureWarning) when loaded. The leaf order is pytree's all the same.
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


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    try:
        return torch.from_numpy(np.empty(0, dtype=dtype)).dtype
    except TypeError as error:
        raise TypeError(f"a sample field of dtype {dtype} cannot go into a torch tensor") from error
