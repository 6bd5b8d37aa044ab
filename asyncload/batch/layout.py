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

    def __init__(self, tree: Any, fields: list[Field], leaves: "tuple[Leaf, ...] | None" = None) -> None:
        self.tree = tree
        self.fields = fields  # what a batch buffer holds: one ``[B, *shape]`` array each
        # None: every leaf of the sample is the fixed field of the same number (the fast path).
        # Otherwise what each leaf is (``Leaf``): the fields are then its storage (``batch/ragged.py``).
        self.leaves = leaves

    @classmethod
    def of(cls, sample: Any) -> "SampleLayout":
        values: list[Any] = []
        tree = flatten_any_named(sample, values)
        if all(isinstance(v, np.ndarray) and is_numeric(v.dtype) for v in values):
            return cls(tree, [Field(v.shape, v.dtype) for v in values])
        fields: list[Field] = []
        leaves = []
        for value in values:
            if isinstance(value, np.ndarray) and is_numeric(value.dtype):
                leaves.append(Leaf("fixed", len(fields), value.dtype, value.shape))
                fields.append(Field(value.shape, value.dtype))
            else:
                leaves.append(Leaf("object"))
        return cls(tree, fields, tuple(leaves))

    def key(self) -> tuple[Any, ...]:
        """What two layouts must share for one's buffers to serve the other."""
        return self.tree, self.fields, self.leaves

    def flatten(self, sample: Any) -> list[np.ndarray] | None:
        """The sample's arrays, one per field, or None when it does not fit this layout as it
        is (another structure or shape: ``batch/ragged.py`` then says how it fits, if it does).
        A dict's values are taken by key, in the layout's order, whatever the sample's own."""
        if self.leaves is not None:
            return None
        arrays: list[np.ndarray] = []
        try:
            if not _flatten_as(sample, self.tree, arrays):
                return None
        except UnsupportedTensor as error:
            raise named(error, sample) from error
        for array, field in zip(arrays, self.fields):  # another dtype: write_any says if it fits
            if array.shape != field.shape or (array.dtype is not field.dtype and array.dtype != field.dtype):
                return None
        return arrays

    def unflatten(self, leaves: Sequence[Any]) -> Any:
        return _unflatten(self.tree, iter(leaves))


@dataclass(frozen=True)
class Leaf:
    """What one leaf of a sample is in the batch: ``fixed`` (an array of one ``shape``: the
    field ``storage``), ``ragged`` (an array whose first dimension varies: fields ``storage``,
    ``[cap, *shape]`` values per row, and ``storage + 1``, its length), ``list`` (an array whose
    other dimensions vary: a list of tensors) or ``object`` (anything else: a list)."""

    kind: str
    storage: int = -1
    dtype: np.dtype | None = None
    shape: tuple[int, ...] = ()


def is_numeric(dtype: np.dtype) -> bool:
    """Whether a torch tensor can hold it (numbers and bool; not str, bytes or objects)."""
    return dtype.kind in "biufc"


def flatten_any(sample: Any, out: list[Any]) -> Any:
    """``_flatten`` that keeps a leaf that is not an array or a number as it is (str, bytes, None,
    any object), rather than make a NumPy array of it. A list that holds no array is one such
    leaf too (each row's list, in a list): parsed JSON (tags, COCO-style annotations) varies in
    its lists' lengths from sample to sample, and as structure every length would be a
    mismatch."""
    if type(sample) is np.ndarray:  # the most common leaf first: this runs per sample
        out.append(sample)
        return None
    if isinstance(sample, dict):
        return {key: flatten_any(value, out) for key, value in sample.items()}
    if isinstance(sample, tuple) or (isinstance(sample, list) and holds_arrays(sample)):
        return tuple(flatten_any(value, out) for value in sample)
    if isinstance(sample, torch.Tensor):
        sample = tensor_array(sample)
    if isinstance(sample, (np.ndarray, np.generic, int, float, bool, complex)):
        out.append(np.asarray(sample))
    else:
        out.append(sample)
    return None


def flatten_any_named(sample: Any, out: list[Any]) -> Any:
    """``flatten_any``, a tensor that is no array named by its field (``named``)."""
    try:
        return flatten_any(sample, out)
    except UnsupportedTensor as error:
        raise named(error, sample) from error


class UnsupportedTensor(TypeError):
    """A tensor in a sample that a batch buffer (NumPy memory on the host) cannot hold."""


def tensor_array(tensor: torch.Tensor) -> np.ndarray:
    """A host tensor's values as a NumPy array (a view); ``UnsupportedTensor`` saying why and
    what to return instead where NumPy cannot hold them (bfloat16 and other dtypes NumPy lacks,
    a tensor on a device, one that requires grad), for ``named`` to add the field's name."""
    try:
        return tensor.numpy()
    except (TypeError, RuntimeError) as error:
        if tensor.device.type != "cpu":
            why = f"a tensor on {tensor.device}: return host values (.cpu())"
        elif tensor.requires_grad:
            why = "a tensor that requires grad: return it without its graph (.detach())"
        else:
            bits = 8 * tensor.element_size()
            why = (f"a {tensor.dtype} tensor, a dtype NumPy (the batch buffers) lacks: return another dtype "
                   f"(.float(), or .view(torch.int{bits}) to keep its bits)")
        raise UnsupportedTensor(why) from error


def named(error: UnsupportedTensor, sample: Any) -> UnsupportedTensor:
    """``error`` with the name of the field it is about (``leaf_names``' spelling): the first
    tensor of ``sample`` that is no array. Only when a sample failed, so a walk of its own."""
    def find(value: Any, name: str) -> str | None:
        if isinstance(value, torch.Tensor):
            try:
                value.numpy()
            except (TypeError, RuntimeError):
                return name or "sample"
            return None
        items = (value.items() if isinstance(value, dict) else enumerate(value)
                 if isinstance(value, (tuple, list)) else ())
        for key, sub in items:
            found = find(sub, f"{name}[{key}]" if isinstance(key, int) else (f"{name}.{key}" if name else str(key)))
            if found:
                return found
        return None
    return UnsupportedTensor(f"field {find(sample, '') or 'sample'!r} is {error}")


def holds_arrays(values: list[Any]) -> bool:
    """Whether a list holds an array or a tensor (at any depth): then it is structure, as a
    tuple is (``[image, label]``); else one Python value (``flatten_any``)."""
    for value in values:
        if isinstance(value, (np.ndarray, torch.Tensor)):
            return True
        if isinstance(value, (list, tuple, dict)) and holds_arrays(list(value.values()) if isinstance(value, dict)
                                                                   else list(value)):
            return True
    return False


MISSING = object()  # nothing at a place (``first_difference``), a key a sample lacks (``_flatten_as``)


def first_difference(tree: Any, other: Any, prefix: str = "") -> tuple[str, Any, Any] | None:
    """The first place where two structures differ (``leaf_names``' spelling) and what each has
    there: what a structure mismatch names, rather than both whole trees. None when equal."""
    if tree is None and other is None:
        return None
    if tree is None or other is None or type(tree) is not type(other):
        return prefix or "sample", tree, other
    if isinstance(tree, dict):
        if tree.keys() != other.keys():  # named here, whole: both key sets
            return prefix or "sample", tree, other
        for key in tree:
            found = first_difference(tree[key], other[key], f"{prefix}.{key}" if prefix else str(key))
            if found:
                return found
        return None
    for key in range(max(len(tree), len(other))):
        mine = tree[key] if key < len(tree) else MISSING
        theirs = other[key] if key < len(other) else MISSING
        found = (first_difference(mine, theirs, f"{prefix}[{key}]") if MISSING not in (mine, theirs)
                 else (f"{prefix}[{key}]", mine, theirs))
        if found:
            return found
    return None


def structure_words(tree: Any) -> str:
    """A structure (or part of one) in words, for a mismatch's message."""
    if tree is MISSING:
        return "nothing"
    if tree is None:
        return "a value"
    if isinstance(tree, dict):
        return f"a dict of {sorted(map(str, tree))}"
    return f"a sequence of {len(tree)}"


def leaf_names(tree: Any, prefix: str = "") -> list[str]:
    """How an error names each leaf: ``boxes``, ``[0]``, ``meta.id``..."""
    if tree is None:
        return [prefix or "sample"]
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    names: list[str] = []
    for key, sub in items:
        name = f"{prefix}[{key}]" if isinstance(key, int) else (f"{prefix}.{key}" if prefix else str(key))
        names += leaf_names(sub, name)
    return names


def _flatten_as(sample: Any, tree: Any, out: list[np.ndarray]) -> bool:
    """Appends the arrays of ``sample`` to ``out`` in the order of the structure ``tree`` (a
    dict's values by key: ``{"b": 1, "a": 2}`` is the same sample as ``{"a": 2, "b": 1}``, so
    its values must not land in each other's fields); False as soon as the structure differs.
    One walk guided by the layout, no structure built and compared: this runs per sample."""
    if tree is None:
        if type(sample) is np.ndarray:  # the most common leaf first
            out.append(sample)
            return True
        if isinstance(sample, (dict, tuple, list)):
            return False
        if isinstance(sample, torch.Tensor):
            sample = tensor_array(sample)
        out.append(np.asarray(sample))
        return True
    if isinstance(tree, dict):
        if not isinstance(sample, dict) or len(sample) != len(tree):
            return False
        for key, sub in tree.items():
            value = sample.get(key, MISSING)
            if value is MISSING or not _flatten_as(value, sub, out):
                return False
        return True
    if not isinstance(sample, (tuple, list)) or len(sample) != len(tree):
        return False
    for value, sub in zip(sample, tree):
        if not _flatten_as(value, sub, out):
            return False
    return True


def in_key_order(sample: Any, tree: Any) -> Any:
    """``sample`` with each dict that has the keys of its place in ``tree`` rebuilt in the
    tree's key order (``flatten_any`` takes values in a dict's own order); a dict of other keys
    stays as it is, for the structure check to name. Tuples and lists keep their type."""
    if isinstance(tree, dict):
        if not isinstance(sample, dict) or sample.keys() != tree.keys():
            return sample
        return {key: in_key_order(sample[key], sub) for key, sub in tree.items()}
    if isinstance(tree, tuple) and isinstance(sample, (tuple, list)) and len(sample) == len(tree):
        values = [in_key_order(value, sub) for value, sub in zip(sample, tree)]
        return values if isinstance(sample, list) else tuple(values)
    return sample


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
