"""Parquet columns that are not one number a row: lists of numbers and structs.

A ``list<float>``/``list<int>`` column gives each row a NumPy array of its own length: the
loader makes that field ragged (a jagged ``torch.nested`` tensor per batch, ``batch/ragged.py``).
A struct column gives each row a dict of its fields (numbers become tensors, strings lists,
as any dict in a sample). They are read with the other small columns, once, and kept compact:
a list column as one flat NumPy array and its offsets (a row's value is a slice, no Python
object a row); a struct column as its rows' dicts.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np


def is_nested(kind: Any) -> bool:
    """Whether a pyarrow type is a list of numbers or a struct (of anything a row can hold)."""
    import pyarrow as pa

    from .parquet_files import is_number

    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        return is_number(kind.value_type)
    return pa.types.is_struct(kind)


def column_leaves(group: Any, names: Sequence[str]) -> list[str]:
    """The column chunks (``path_in_schema``) of the top-level columns ``names`` in a row group:
    a list's ``name.list.element``, each field of a struct."""
    wanted = set(names)
    paths = [group.column(n).path_in_schema for n in range(group.num_columns)]
    return [path for path in paths if path in wanted or path.split(".", 1)[0] in wanted]


class NestedColumn:
    """One list or struct column of every row, in source order; ``value(index)`` is a row's."""

    def __init__(self, name: str, parts: list[Any]) -> None:
        import pyarrow as pa
        import pyarrow.compute as pc

        column = pa.concat_arrays([part.combine_chunks() if hasattr(part, "combine_chunks") else part for part in parts])
        self.name = name
        self.nulls = np.asarray(column.is_null().to_numpy(zero_copy_only=False), dtype=bool)
        self.rows: list[Any] | None = None
        if pa.types.is_struct(column.type):
            self.rows = column.to_pylist()
            return
        lengths = pc.fill_null(pc.list_value_length(column), 0).to_numpy(zero_copy_only=False).astype(np.int64)
        self.offsets = np.concatenate(([0], np.cumsum(lengths)))
        flat = pc.list_flatten(column)
        self.values = np.asarray(flat.to_numpy(zero_copy_only=False))
        if flat.null_count:
            raise TypeError(f"column {name!r} has a null inside a list: a list field must be numbers")

    def value(self, index: int) -> Any:
        if self.rows is not None:
            return self.rows[index]
        return self.values[self.offsets[index] : self.offsets[index + 1]]


def nested_parts(table: Any, name: str) -> Any:
    """A row group's part of a nested column (an Arrow array)."""
    return table.column(name).combine_chunks()
