"""Parquet files (a folder or bucket prefix of ``*.parquet``, including the layout Hugging Face
``datasets`` writes: ``data/train-00000-of-00004.parquet``, the image column as bytes or as a
``{"bytes", "path"}`` struct) read as a tar shard set is: row groups play the shards' role.

Why it is a ``ShardSource``: the order (``ShardSampler``: row groups shuffled from ``(seed,
epoch)``, a contiguous part per rank, a buffer shuffle within), the read plan (one ranged read
per row group, of its image column chunk only), the processes' chunk ownership, resume and the
disk cache (``cache_dir``) are the tar shards' code, unchanged. What differs is how a read's
bytes become samples (``split_chunk``: pyarrow parses the row group from the ranged read and the
footer) and what is read up front: each file's footer, and the label and ``columns=`` of every
row group (small: a few bytes a row), so labels are known before any image is read, as a tar
shard index knows them.

Why string ``columns`` never enter the pipeline: a batch buffer holds fixed-shape arrays, and the
strings are in this (the parent) process already. The hand-out (``epoch/handout.py``), on the user's
thread, asks ``host_fields`` for the strings of the rows it delivers and puts them in the batch as
lists, so ``processes=N`` moves no string per sample and a child never reads them.

A row whose image or label (or a numeric ``columns=`` value) is null fails its read, naming the
row (``file.parquet#row``), and follows ``on_error`` like any unreadable sample; a null string is
``None`` in its list.
"""

from __future__ import annotations

import json
import struct
from typing import Any, Sequence

import numpy as np

from .parquet_files import (TAIL_BYTES, column_text, column_values, footer_of, is_number, is_text, leaf_range,
                            list_parquet, metadata_of, pyarrow_parquet, read_group, read_ranges, refuse_kind)
from .parquet_nested import NestedColumn, column_leaves, is_nested, nested_parts
from .shards import ShardSample, ShardSource


class ParquetSource(ShardSource):
    """The rows of Parquet files as ``(ShardSample, label)`` items (``ShardSample`` items with
    ``label=None``); a row reads as its image's bytes, or with ``columns`` as ``(bytes, {name:
    value})`` (the loader then gives each batch as ``({"image": images, name: values}, labels)``:
    a tensor for a numeric column, a ``list`` of ``str`` for a string column, see ``host_fields``).
    Build it with ``parquet(url)``. ``shuffle_buffer``, ``chunk_bytes`` (here: the cache's
    download size), ``cache_dir`` and ``cache_bytes`` are ``ShardSource``'s."""

    read_whole = True  # a row group is parsed whole: one read per row group, never split

    def __init__(self, files: Sequence[tuple[str, int]], image: str = "image", label: str | None = "label", *,
                 columns: Sequence[str] | None = None, storage_options: dict | None = None,
                 shuffle_buffer: int = 1000, chunk_bytes: int = 16 << 20, cache_dir: str | None = None,
                 cache_bytes: int | None = None, timeout: float | None = None, retries: int | None = None) -> None:
        self.storage_options = storage_options
        self.members = "image"
        self.shuffle_buffer = max(1, shuffle_buffer)
        self.chunk_bytes = chunk_bytes
        self.cache_dir = cache_dir
        self.cache_bytes = cache_bytes
        self.image, self.label, self.columns = image, label, list(columns or [])
        self.files = [url for url, _ in files]
        self.file_bytes = np.array([size for _, size in files], dtype=np.int64)
        self.footers = self._read_footers(timeout, retries)
        self._metadata: dict[int, Any] = {}
        self._index_groups()
        self._read_small_columns(timeout, retries)

    def _read_footers(self, timeout: float | None, retries: int | None) -> list[bytes]:
        sizes = self.file_bytes.tolist()
        starts = [max(0, size - TAIL_BYTES) for size in sizes]
        tails = read_ranges(self.files, starts, sizes, self.storage_options, timeout, retries)
        footers = [footer_of(tail, url) for tail, url in zip(tails, self.files)]
        long = [n for n, footer in enumerate(footers) if not footer]  # a footer larger than the tail
        if long:  # its length is in the tail's last 8 bytes: read exactly the footer, not the file
            starts = [sizes[n] - 8 - struct.unpack("<I", tails[n][-8:-4])[0] for n in long]
            exact = read_ranges([self.files[n] for n in long], starts, [sizes[n] for n in long],
                                self.storage_options, timeout, retries)
            for n, data in zip(long, exact):
                footers[n] = footer_of(data, self.files[n])
        return footers

    def metadata(self, file: int) -> Any:
        """File ``file``'s ``FileMetaData``, parsed once per process from its footer."""
        if file not in self._metadata:
            self._metadata[file] = metadata_of(self.footers[file])
        return self._metadata[file]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_metadata": {}}  # footers travel as bytes; each process parses its own

    def _index_groups(self) -> None:
        """Row groups as shards: their file, number, rows and image chunk's byte range."""
        group_file, group_number, rows, begin, end, leaves = [], [], [], [], [], []
        self.classes: list[str] = []
        for file, url in enumerate(self.files):
            metadata = self.metadata(file)
            leaf = self._image_leaf(metadata, url)
            leaves.append(leaf)
            if not self.classes:
                self.classes = _class_names(metadata, self.label)
            for number in range(metadata.num_row_groups):
                group = metadata.row_group(number)
                if group.num_rows == 0:
                    continue
                start, stop = leaf_range(group, [leaf])
                group_file.append(file), group_number.append(number), rows.append(group.num_rows)
                begin.append(start), end.append(stop)
        self.image_leaf = leaves
        self.group_file = np.array(group_file, dtype=np.int32)
        self.group_number = np.array(group_number, dtype=np.int32)
        self.urls = [self.files[f] for f in group_file]
        self.shard_bytes = self.file_bytes[self.group_file] if group_file else np.zeros(0, np.int64)
        counts = np.array(rows, dtype=np.int64)
        self.shard_of = np.repeat(np.arange(len(rows), dtype=np.int32), counts)
        self.shard_first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.sample_begin = np.repeat(np.array(begin, dtype=np.int64), counts)
        self.sample_end = np.repeat(np.array(end, dtype=np.int64), counts)
        file_rows = np.bincount(self.group_file, weights=counts, minlength=len(self.files)).astype(np.int64)
        self.file_first = np.concatenate([[0], np.cumsum(file_rows)]).astype(np.int64)

    def _image_leaf(self, metadata: Any, url: str) -> str:
        """The column chunk that holds the image bytes: ``image``, or ``image.bytes`` for HF's struct."""
        import pyarrow as pa

        schema = metadata.schema.to_arrow_schema()
        names = schema.names
        for name in [self.image, *([self.label] if self.label else []), *self.columns]:
            if name not in names:
                raise KeyError(f"{url} has no column {name!r} (its columns: {', '.join(names)})"
                               + ("; pass label=None for unlabelled rows" if name == self.label else ""))
        kind = schema.field(self.image).type
        if pa.types.is_struct(kind) and kind.get_field_index("bytes") >= 0:
            return f"{self.image}.bytes"
        if pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
            return self.image
        raise TypeError(f"{url}: column {self.image!r} is {kind}, not image bytes (binary, or a struct with 'bytes')")

    def _read_small_columns(self, timeout: float | None, retries: int | None) -> None:
        """The label and ``columns`` of every row group, one ranged read each: numbers as NumPy
        arrays (``values``, sent to the pipeline with each row), strings as Arrow arrays
        (``strings``, kept here for ``host_fields``); a column's kind is its type in the first file."""
        names = [*([self.label] if self.label else []), *self.columns]
        schema = self.metadata(0).schema.to_arrow_schema() if self.files else None
        texts = {name for name in self.columns if schema is not None and is_text(schema.field(name).type)}
        nested = {name for name in self.columns if schema is not None and is_nested(schema.field(name).type)}
        for name in names:  # before any read
            if schema is not None and name not in texts | nested and not is_number(schema.field(name).type):
                raise refuse_kind(name, schema.field(name).type)
        self.number_columns = [name for name in self.columns if name not in texts | nested]
        self.nested: dict[str, NestedColumn] = {}  # list and struct columns (parquet_nested.py)
        self.string_columns = [name for name in self.columns if name in texts]
        self.values: dict[str, np.ndarray] = {}
        self.strings: dict[str, Any] = {}
        self.nulls = np.zeros(len(self), dtype=bool)
        self._null_columns: dict[str, np.ndarray] = {}
        if not names:
            self.labels = None
            return
        groups = [self.metadata(f).row_group(n) for f, n in zip(self.group_file.tolist(), self.group_number.tolist())]
        ranges = [leaf_range(group, column_leaves(group, names)) for group in groups]
        datas = read_ranges(self.urls, [r[0] for r in ranges], [r[1] for r in ranges], self.storage_options, timeout, retries)
        parts: dict[str, list[Any]] = {name: [] for name in names}
        masks: dict[str, list[np.ndarray]] = {name: [] for name in names if name not in texts | nested}
        for group, ((start, _), data) in enumerate(zip(ranges, datas)):
            file = int(self.group_file[group])
            table = read_group(self.metadata(file), int(self.file_bytes[file]), self.footers[file],
                               int(self.group_number[group]), [(start, data)], names)
            for name in names:
                if name in texts or name in nested:
                    parts[name].append(column_text(table, name) if name in texts else nested_parts(table, name))
                    continue
                values, nulls = column_values(table, name)
                parts[name].append(values)
                masks[name].append(np.zeros(len(values), bool) if nulls is None else nulls)
        import pyarrow as pa

        for name in texts:
            self.strings[name] = pa.concat_arrays(parts[name]) if parts[name] else pa.array([], pa.large_string())
        for name in nested:
            self.nested[name] = NestedColumn(name, parts[name])
            if self.nested[name].nulls.any():
                self._null_columns[name] = self.nested[name].nulls
                self.nulls |= self.nested[name].nulls
        for name in masks:
            self.values[name] = np.concatenate(parts[name]) if parts[name] else np.zeros(0)
            mask = np.concatenate(masks[name]) if masks[name] else np.zeros(0, bool)
            if mask.any():
                self._null_columns[name] = mask
                self.nulls |= mask
        self.labels = self.values.pop(self.label).astype(np.int64) if self.label else None

    def host_fields(self, indices: Sequence[int] | np.ndarray) -> dict[str, list[str | None]]:
        """The string columns of rows ``indices`` (source indices, in the batch's row order), one
        list a column, ``None`` where a value is null. The hand-out calls it on the user's thread
        for each batch when ``string_columns`` is not empty: one Arrow take a column, no I/O."""
        import pyarrow as pa

        rows = pa.array(np.asarray(indices, dtype=np.int64))
        return {name: self.strings[name].take(rows).to_pylist() for name in self.string_columns}

    def __getitem__(self, index: int) -> Any:  # type: ignore[override]
        index = int(index)
        if not -len(self) <= index < len(self):
            raise IndexError(f"ParquetSource index {index} out of range for {len(self)} rows")
        index %= len(self)
        file = int(self.group_file[self.shard_of[index]])
        sample = ShardSample(self.files[file], str(index - int(self.file_first[file])), index)
        return sample if self.labels is None else (sample, int(self.labels[index]))

    def __len__(self) -> int:
        return int(self.shard_first[-1])

    def __repr__(self) -> str:
        return f"ParquetSource({len(self)} rows in {len(self.urls)} row groups of {len(self.files)} files)"

    def split_chunk(self, view: memoryview, base: int, indices: list[int]) -> dict[int, Any]:
        """Each row of ``indices`` (all of one row group) as it reads: its image's bytes (with
        ``columns``, ``(bytes, {name: value})``), or the ValueError that fails a null row. pyarrow
        parses the row group's image chunk from ``view`` (its bytes from offset ``base``) and the
        footer; each image is a copy, so a row waiting in the shuffle does not hold the read."""
        group = int(self.shard_of[indices[0]])
        file = int(self.group_file[group])
        table = read_group(self.metadata(file), int(self.file_bytes[file]), self.footers[file],
                           int(self.group_number[group]), [(base, view)], [self.image_leaf[file]])
        column = table.column(0).combine_chunks()
        if self.image_leaf[file] != self.image:
            column = column.flatten()[0]  # the struct's "bytes" (the only child read), null where the struct is
        images = column.to_pylist()
        first = int(self.shard_first[group])
        out: dict[int, Any] = {}
        for index in indices:
            image = images[index - first]
            if image is None or self.nulls[index]:
                row = index - int(self.file_first[file])
                out[index] = ValueError(f"row {row} of {self.files[file]}: {self._null_what(index, image is None)} is null")
            elif self.columns:  # strings are not sent: the hand-out adds them (host_fields)
                out[index] = (image, {**{name: self.values[name][index] for name in self.number_columns},
                                      **{name: column.value(index) for name, column in self.nested.items()}})
            else:
                out[index] = image
        return out

    def _null_what(self, index: int, image: bool) -> str:
        names = [self.image] if image else []
        names += [name for name, mask in self._null_columns.items() if mask[index]]
        return "column " + ", ".join(repr(name) for name in names)


class ColumnsDecoder:
    """A row with ``columns``, ``(image bytes, {name: value})`` -> ``{"image": decoded, name:
    value}``: the image through ``decode`` (the user's or the default), the numbers as they are,
    so each becomes a batch field (a tensor of ``[batch]``)."""

    def __init__(self, decode: Any) -> None:
        self.decode = decode

    def __call__(self, row: tuple[bytes, dict[str, Any]]) -> dict[str, Any]:
        image, values = row  # a list column's value is an array already, a struct's a dict
        return {"image": self.decode(image), **{name: value if isinstance(value, dict) else np.asarray(value)
                                                for name, value in values.items()}}


def _class_names(metadata: Any, label: str | None) -> list[str]:
    """The label's class names where Hugging Face ``datasets`` recorded them (a ClassLabel)."""
    raw = (metadata.metadata or {}).get(b"huggingface")
    if not raw or not label:
        return []
    try:
        feature = json.loads(raw)["info"]["features"][label]
        return list(feature.get("names", [])) if feature.get("_type") == "ClassLabel" else []
    except (KeyError, TypeError, ValueError):
        return []


def parquet(url: str | Sequence[str], image: str = "image", label: str | None = "label", *,
            columns: Sequence[str] | None = None, storage_options: dict | None = None,
            timeout: float | None = None, retries: int | None = None, **options: Any) -> ParquetSource:
    """The rows of the Parquet files at ``url``: a file, a folder or bucket prefix (every
    ``*.parquet`` under it), a glob (``.../data/train-*.parquet``: one split of a Hugging Face
    dataset) or a list of them. ``image``: the column of encoded images (binary, or HF's
    ``{"bytes", "path"}`` struct); ``label``: an integer column (None: no labels); ``columns``:
    columns delivered as batch fields: with any, a batch is ``({"image": images, name: values},
    labels)``, a numeric column's values a tensor, a string column's a ``list`` of ``str`` in the
    batch's row order (``None`` for a null string; a null number fails its row). Reads each file's
    footer and these small columns now (ranged reads) and keeps them in memory (strings as
    compact Arrow arrays); the loader's hand-out adds the strings to each batch, so they cost no
    pipeline or child process work. The images are read by the loader, one ranged read per row group. ``options``
    are ``ShardSource``'s: ``shuffle_buffer``, ``chunk_bytes``, ``cache_dir``, ``cache_bytes``."""
    pyarrow_parquet()
    files = list_parquet(url, storage_options, timeout, retries)
    return ParquetSource(files, image, label, columns=columns, storage_options=storage_options,
                         timeout=timeout, retries=retries, **options)
