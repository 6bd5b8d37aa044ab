"""Parquet columns that are not one number a row: lists of numbers and structs.

A ``list<float>``/``list<int>`` column gives each row a NumPy array of its own length, a
``list<list<float>>`` (or ``list<fixed_size_list<float, 4>>``) one of ``[N, width]`` (boxes
N x 4: every inner list of the column one length): the loader makes that field ragged (a
jagged ``torch.nested`` tensor per batch, ``batch/ragged.py``).
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

    if is_list(kind):
        inner = kind.value_type
        return is_number(inner) or (is_list(inner) and is_number(inner.value_type))
    return pa.types.is_struct(kind)


def is_list(kind: Any) -> bool:
    import pyarrow as pa

    return pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)


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
        self.width: int | None = None
        if pa.types.is_struct(column.type):
            self.rows = column.to_pylist()
            return
        lengths = pc.fill_null(pc.list_value_length(column), 0).to_numpy(zero_copy_only=False).astype(np.int64)
        self.offsets = np.concatenate(([0], np.cumsum(lengths)))
        flat = pc.list_flatten(column)
        if flat.null_count:
            raise TypeError(f"column {name!r} has a null inside a list: a list field must be numbers")
        if is_list(flat.type):  # list<list<number>>: each row N x width (boxes N x 4)
            flat = self._rows_of_width(flat)
        self.values = np.asarray(flat.to_numpy(zero_copy_only=False))
        if self.width is not None:
            self.values = self.values.reshape(int(self.offsets[-1]), self.width)

    def _rows_of_width(self, inner: Any) -> Any:
        """The numbers of a ``list<list<number>>`` column's inner lists, which must all have one
        length (the field's width, as a ragged field's trailing dimension); sets ``width``."""
        import pyarrow as pa
        import pyarrow.compute as pc

        if pa.types.is_fixed_size_list(inner.type):
            self.width = inner.type.list_size
        else:
            lengths = np.unique(pc.list_value_length(inner).to_numpy(zero_copy_only=False))
            if len(lengths) > 1:
                raise TypeError(f"column {self.name!r} is a list of lists of {len(lengths)} lengths "
                                f"({', '.join(map(str, lengths[:4]))}...): each inner list must have one length "
                                f"(a ragged [N, width] field)")
            self.width = int(lengths[0]) if len(lengths) else 0
        flat = pc.list_flatten(inner)
        if flat.null_count:
            raise TypeError(f"column {self.name!r} has a null inside a list: a list field must be numbers")
        return flat

    def value(self, index: int) -> Any:
        if self.rows is not None:
            return self.rows[index]
        return self.values[self.offsets[index] : self.offsets[index + 1]]


def nested_parts(table: Any, name: str) -> Any:
    """A row group's part of a nested column (an Arrow array)."""
    return table.column(name).combine_chunks()
