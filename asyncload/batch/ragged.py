"""Samples that are not fixed-shape arrays: ragged fields, lists of tensors and Python values.

A batch buffer holds fixed-shape fields only (that is what the fast path writes, and what
``processes=N`` shares). Beside that, a layout may say a leaf is (``Leaf``):

- ``ragged``: its first dimension varies. Two fields hold it: ``[B, cap, *shape]`` values,
  each row's written at the start of its own slot by the decode thread, as a fixed field's row
  is (so also in a child's shared segment), and ``[B]`` lengths. A row longer than ``cap`` goes
  aside (below), its length -1. ``cap`` follows the batches' typical lengths (``new_cap``).
- ``list``: its other dimensions vary (images at their own size). Three fields: ``[B, cap]``
  values (each row's, flat), ``[B]`` their count (-1: aside) and ``[B, ndim]`` its shape; so
  these too are written in place, not pickled, unless past ``cap``.
- ``object``: not an array (str, bytes, None, objects). Its values go aside.

"Aside" is the buffer's ``side`` dict, ``(row, leaf) -> value``: a child sends the entries of
a fill's rows in its ``Done`` answer (pickled once per batch, not per sample), this process
merges them into its own buffer. A sample that does not fit its buffer's layout but can (a
fixed leaf of another length, a ragged one past ``cap``) also goes aside, so no sample is lost
or reordered, and the driver ``grow``s the run's layout from what went aside: later buffers
have the leaf ragged (or a bigger ``cap``, or a list) for the rest of the run. Anything else
(a dtype the field's cannot hold exactly, such as int64 into int32 or float64 into int64,
another number of dimensions, another structure, an array where there was an object, or a
missing value) is a real mismatch: ``FieldMismatch``, naming the field and both shapes. A dict's
values are matched by key (``in_key_order``); a dict of other keys names both key sets.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .crossing import must_cross
from .layout import (Field, Leaf, SampleLayout, first_difference, flatten_any_named, in_key_order, is_numeric,
                     leaf_names, structure_words)

FIRST_CAP = 8  # the least room a ragged row gets (values), so short ones rarely go aside
ASIDE_SHARE = 1 / 16  # a ragged leaf's room grows once more of a batch's rows than this went aside
RAGGED_BYTES = 32 << 20  # the most a ragged field's values take in one batch buffer (its rows' room)


class FieldMismatch(ValueError):
    """A sample's field cannot take its place in the batch: another dtype, number of dimensions
    or structure than the samples before it."""


def write_any(buffer: Any, row: int, sample: Any) -> None:
    """Writes ``sample`` into ``row`` of ``buffer`` by its layout's leaves: fixed and ragged
    values into the buffer's arrays, the rest into ``buffer.side``. Checks every leaf before
    writing any, so a sample that fails leaves nothing aside."""
    layout: SampleLayout = buffer.layout
    values: list[Any] = []
    tree = flatten_any_named(in_key_order(sample, layout.tree), values)  # a dict's values by key
    if tree != layout.tree:
        where, mine, theirs = first_difference(tree, layout.tree) or ("sample", tree, layout.tree)
        raise FieldMismatch(f"the sample's structure differs from the samples' before it at {where!r}: "
                            f"{structure_words(mine)} there, where they had {structure_words(theirs)}")
    leaves = layout.leaves if layout.leaves is not None else fixed_leaves(layout)
    arrays, side, aside = buffer.arrays, buffer.side, []
    writes = []
    for number, (leaf, value) in enumerate(zip(leaves, values)):
        where = place(leaf, value, layout, number)
        if where == "aside":
            if buffer.crosses:  # written in a child: the value must travel to the parent
                must_cross(layout, number, value)
            aside.append((number, value))
        else:
            writes.append((leaf, value))
    for leaf, value in writes:
        if leaf.kind == "fixed":
            np.copyto(arrays[leaf.storage][row, ...], value, casting="same_kind")
        elif leaf.kind == "ragged":  # fits its slot
            np.copyto(arrays[leaf.storage][row, : len(value)], value, casting="same_kind")
            arrays[leaf.storage + 1][row] = len(value)
        else:  # a list leaf's values, flat, and its shape
            np.copyto(arrays[leaf.storage][row, : value.size], value.reshape(-1), casting="same_kind")
            arrays[leaf.storage + 1][row] = value.size
            arrays[leaf.storage + 2][row] = value.shape
    for number, value in aside:
        leaf = leaves[number]
        if leaf.kind in ("ragged", "list") and leaf.storage >= 0:
            arrays[leaf.storage + 1][row] = -1
        side[row, number] = np.array(value) if isinstance(value, np.ndarray) else value


def place(leaf: Leaf, value: Any, layout: SampleLayout, number: int) -> str:
    """Where ``value`` goes for ``leaf``: ``"row"`` (the buffer's arrays) or ``"aside"``; raises
    ``FieldMismatch`` when it cannot be the same field as the samples' before it."""
    if leaf.kind == "object":
        return "aside"
    if not isinstance(value, np.ndarray) or not is_numeric(value.dtype):
        raise mismatch(layout, number, leaf, value)
    assert leaf.dtype is not None
    if not np.can_cast(value.dtype, leaf.dtype, "safe") or value.ndim != len(leaf.shape) + (leaf.kind == "ragged"):
        raise mismatch(layout, number, leaf, value)
    if leaf.kind == "fixed":
        return "row" if value.shape == leaf.shape else "aside"
    if leaf.kind == "ragged":
        cap = layout.fields[leaf.storage].shape[0]
        return "row" if value.shape[1:] == leaf.shape and len(value) <= cap else "aside"
    if leaf.storage < 0:  # a list leaf of a layout from before it turned (no storage)
        return "aside"
    return "row" if value.size <= layout.fields[leaf.storage].shape[0] else "aside"


def mismatch(layout: SampleLayout, number: int, leaf: Leaf, value: Any) -> FieldMismatch:
    name = leaf_names(layout.tree)[number]
    if isinstance(value, np.ndarray):
        got = f"{value.dtype} array of shape {value.shape}"
    else:
        got = type(value).__name__
    if leaf.kind == "object":
        was = "Python values"
    else:
        shape = leaf.shape if leaf.kind == "fixed" else ("N", *leaf.shape) if leaf.kind == "ragged" else "varying"
        was = f"{leaf.dtype} arrays of shape {shape}"
    hint = ""
    if isinstance(value, np.ndarray) and leaf.dtype is not None and not np.can_cast(value.dtype, leaf.dtype, "safe"):
        hint = f" (a {leaf.dtype} field cannot hold {value.dtype} values exactly: give every sample one dtype)"
    return FieldMismatch(f"field {name!r} is {got}, but the samples before it had {was}{hint}")


def fixed_leaves(layout: SampleLayout) -> tuple[Leaf, ...]:
    """The leaves of a layout of fixed fields only (``leaves`` None)."""
    return tuple(Leaf("fixed", number, f.dtype, f.shape) for number, f in enumerate(layout.fields))


def grow(layout: SampleLayout, side: dict[tuple[int, int], Any], rows: int = 0) -> SampleLayout:
    """The layout that takes what went aside in place: a fixed leaf with values of other
    lengths turns ragged, one whose other dimensions varied turns a list; a ragged leaf's room
    (``cap``) grows by ``new_cap`` from the typical lengths of the batch's ``rows`` rows, not
    from its longest value: a row longer than its room goes aside safely, so one huge sample
    must not make every buffer of the run huge. ``layout`` itself when nothing changes."""
    leaves = list(layout.leaves if layout.leaves is not None else fixed_leaves(layout))
    caps = {number: layout.fields[leaf.storage].shape[0] for number, leaf in enumerate(leaves)
            if leaf.kind in ("ragged", "list") and leaf.storage >= 0}
    lengths: dict[int, list[int]] = {}
    changed = False
    for (_, number), value in side.items():
        leaf = leaves[number]
        if leaf.kind == "object" or not isinstance(value, np.ndarray):
            continue
        if leaf.kind == "list":
            lengths.setdefault(number, []).append(value.size)
            continue
        trailing = leaf.shape if leaf.kind == "ragged" else leaf.shape[1:]
        if value.ndim == 0 or value.shape[1:] != trailing:
            leaves[number], changed = Leaf("list", -1, leaf.dtype, (-1,) * value.ndim), True
            caps[number], lengths[number] = 0, [value.size]
            continue
        if leaf.kind == "fixed":
            leaves[number], changed = Leaf("ragged", -1, leaf.dtype, trailing), True
            caps[number] = 0
            lengths[number] = []
        lengths.setdefault(number, []).append(len(value))
    for number, long in lengths.items():
        old = caps[number]
        was = layout.leaves[number] if layout.leaves is not None else fixed_leaves(layout)[number]
        now = leaves[number]
        others = old if was.kind != "fixed" else was.shape[0] if now.kind == "ragged" else int(np.prod(was.shape))
        cap = new_cap(old, long, max(rows, len(long)), others, now)
        if cap != old:
            caps[number], changed = cap, True
    if not changed:
        return layout
    return with_storage(layout, leaves, caps)


def new_cap(cap: int, aside: list[int], rows: int, others: int, leaf: Leaf) -> int:
    """A ragged leaf's room per row after ``aside`` (lengths longer than their room) went aside
    out of a batch of ``rows``, the others at most ``others`` long: unchanged (``cap``) unless
    more than ``ASIDE_SHARE`` of the rows went aside, else twice the lengths' 90th percentile,
    within ``RAGGED_BYTES`` for the batch's field. A new ragged leaf (``cap`` 0) always gets room."""
    if cap and len(aside) <= max(1, ASIDE_SHARE * rows):
        return cap
    typical = sorted(aside + [others] * (rows - len(aside)))[int(0.9 * (rows - 1))]
    assert leaf.dtype is not None
    item = leaf.shape if leaf.kind == "ragged" else ()  # a list leaf's room counts its elements
    row_bytes = max(1, leaf.dtype.itemsize * int(np.prod(item, dtype=np.int64)) * max(rows, 1))
    return max(cap, min(max(FIRST_CAP, 2 * typical), max(FIRST_CAP, RAGGED_BYTES // row_bytes)))


def with_storage(layout: SampleLayout, leaves: list[Leaf], caps: dict[int, int]) -> SampleLayout:
    """A layout of ``leaves`` with their storage fields numbered afresh."""
    fields: list[Field] = []
    placed = []
    for number, leaf in enumerate(leaves):
        assert leaf.dtype is not None or leaf.kind == "object"
        if leaf.kind == "fixed":
            placed.append(Leaf("fixed", len(fields), leaf.dtype, leaf.shape))
            fields.append(Field(leaf.shape, leaf.dtype))  # type: ignore[arg-type]
        elif leaf.kind == "ragged":
            placed.append(Leaf("ragged", len(fields), leaf.dtype, leaf.shape))
            fields += [Field((caps[number], *leaf.shape), leaf.dtype), Field((), np.dtype(np.int64))]  # type: ignore[arg-type]
        elif leaf.kind == "list":  # its values flat, their count, its shape
            placed.append(Leaf("list", len(fields), leaf.dtype, leaf.shape))
            fields += [Field((caps[number],), leaf.dtype), Field((), np.dtype(np.int64)),  # type: ignore[arg-type]
                       Field((len(leaf.shape),), np.dtype(np.int64))]
        else:
            placed.append(Leaf(leaf.kind, -1, leaf.dtype, leaf.shape))
    return SampleLayout(layout.tree, fields, tuple(placed))


def used_parts(buffer: Any, size: int) -> list[Any]:
    """The first ``size`` rows of each of ``buffer``'s tensors, a ragged field's values cut to
    the longest row's length: what a copy to the GPU needs (not the whole ``[B, cap]`` room)."""
    parts = [tensor[:size] for tensor in buffer.tensors]
    for leaf in buffer.layout.leaves or ():
        if leaf.kind in ("ragged", "list") and leaf.storage >= 0 and buffer.arrays[leaf.storage + 1] is not None:
            longest = int(buffer.arrays[leaf.storage + 1][:size].max(initial=0))
            parts[leaf.storage] = parts[leaf.storage][:, :longest]
    return parts


def take_aside(buffer: Any, rows: Any) -> dict[tuple[int, int], Any]:
    """Removes and returns what ``rows`` of ``buffer`` put aside (a fill's, for its answer)."""
    wanted = set(rows)
    side = buffer.side
    return {key: side.pop(key) for key in [key for key in list(side) if key[0] in wanted]}


def take_in(ring: Any, buffer: Any, side: dict[tuple[int, int], Any], stats: Any = None) -> None:
    """On the driver: values a fill put aside join its batch's ``buffer``, and ``ring``'s layout
    grows to take them in place from now on (a field turned ragged, or longer): buffers taken
    from now on have it; those already taken keep theirs (``assemble`` converts them). ``stats``
    counts their bytes (arrays' and text's; 8 for any other object)."""
    buffer.side.update(side)
    if stats is not None:
        stats.add_aside(sum(value.nbytes if isinstance(value, np.ndarray) else len(value) if isinstance(
            value, (str, bytes)) else 8 for value in side.values()))
    grown = grow(ring.layout, side, ring.capacity)
    if grown is not ring.layout:
        ring.configure(grown, ring.capacity, *([ring.on_device] if hasattr(ring, "on_device") else []))
