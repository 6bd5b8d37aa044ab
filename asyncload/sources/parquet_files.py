"""What ``parquet()`` reads once, before a loader runs: the files (a folder, a prefix, a glob or
a list), each file's footer (the metadata of its row groups) by one ranged read of its tail, and
the small columns (the label, numeric and string ``columns=``) of every row group by one ranged
read each.

Why footers are kept as bytes: they are what a child process (``processes=N``) needs to parse a
row group, they pickle as they are, and pyarrow parses one in microseconds. Why a ``RangeFile``:
pyarrow parses a row group from a file-like object; this one serves only the byte ranges read
(the row group's column chunks and the footer), so a file is never read whole, and a read
outside them is a bug that fails loudly rather than a silent whole-file download.
"""

from __future__ import annotations

import io
import struct
from typing import Any, Sequence

import numpy as np

from . import listing

TAIL_BYTES = 64 << 10  # the first read of a file's end: the footer of most files fits
GLOB_CHARS = "*?["
INSTALL_HINT = "pip install 'asyncload[parquet]'"


def pyarrow_parquet() -> Any:
    """``pyarrow.parquet``, or an ImportError that says how to install it."""
    try:
        import pyarrow.parquet as pq
    except ImportError as error:
        raise ImportError(f"reading or writing Parquet needs pyarrow: {INSTALL_HINT}") from error
    return pq


class RangeFile(io.RawIOBase):
    """A read-only file of ``size`` bytes of which only ``parts`` (``(offset, bytes)`` pairs) are
    known: what pyarrow needs to parse one row group's column chunks with its file's footer.

    Why not fsspec's helpers (fsspec 2026.9 read): ``fsspec.parquet.open_parquet_file`` does its
    own reads, synchronously, through the filesystem, while a row group's bytes here come from the
    reader (on the event loop, with its retries, timeout, size budget, stats and the shard cache,
    perhaps in a child process): it would read them a second time or not through the loader at
    all. Its cache, ``fsspec.caching.KnownPartsOfAFile`` (the "parts" cache type), is no file
    object (this class would stay, less its ``read``), joins adjacent parts by concatenating
    bytes and slices ``bytes`` on each read (a copy of a row group's image column each time, where
    ``memoryview`` here copies nothing), and by default pads a read outside the known parts with
    zeros, where a read outside them here is a bug that must fail loudly."""

    def __init__(self, size: int, parts: Sequence[tuple[int, Any]]) -> None:
        super().__init__()
        self.size = size
        self.parts = [(offset, memoryview(data)) for offset, data in parts]
        self.position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = 0) -> int:
        self.position = offset if whence == 0 else self.position + offset if whence == 1 else self.size + offset
        return self.position

    def read(self, size: int = -1) -> memoryview:  # type: ignore[override]
        if size is None or size < 0:
            size = self.size - self.position
        size = min(size, self.size - self.position)
        for offset, view in self.parts:
            if offset <= self.position and self.position + size <= offset + len(view):
                start = self.position - offset
                self.position += size
                return view[start : start + size]  # pyarrow takes any buffer: no copy of a whole row group
        raise ValueError(f"bytes [{self.position}, {self.position + size}) were not read (parsing a row group "
                         f"needs only its column chunks and the footer)")


def footer_of(tail: bytes, url: str) -> bytes:
    """The footer (metadata, its length and the magic) at the end of ``tail``, the last bytes of
    file ``url``; raises ValueError if the tail is not a Parquet file's end."""
    if len(tail) < 12 or tail[-4:] != b"PAR1":
        raise ValueError(f"{url}: not a Parquet file (no PAR1 at its end)")
    length = struct.unpack("<I", tail[-8:-4])[0]
    return tail[-(length + 8):] if length + 8 <= len(tail) else b""


def metadata_of(footer: bytes) -> Any:
    """The ``FileMetaData`` that ``footer`` holds."""
    pq = pyarrow_parquet()
    import pyarrow as pa

    return pq.read_metadata(pa.BufferReader(footer))


def leaf_range(group: Any, leaves: Sequence[str]) -> tuple[int, int]:
    """Bytes ``[start, end)`` of row group ``group`` that hold the column chunks ``leaves``
    (paths such as ``image.bytes``): in a Parquet file a row group's chunks lie side by side."""
    starts, ends = [], []
    wanted = set(leaves)
    for number in range(group.num_columns):
        column = group.column(number)
        if column.path_in_schema in wanted:
            start = column.data_page_offset
            if column.has_dictionary_page and column.dictionary_page_offset:
                start = min(start, column.dictionary_page_offset)
            starts.append(start)
            ends.append(start + column.total_compressed_size)
    missing = wanted - {group.column(n).path_in_schema for n in range(group.num_columns)}
    if missing:
        raise ValueError(f"no column chunk {sorted(missing)} in the row group")
    return min(starts), max(ends)


def read_group(metadata: Any, size: int, footer: bytes, group: int, parts: Sequence[tuple[int, Any]],
               leaves: Sequence[str]) -> Any:
    """The columns ``leaves`` of row group ``group`` as a pyarrow Table, parsed from ``parts``
    (the ranged reads that hold their column chunks) and the footer."""
    pq = pyarrow_parquet()
    file = RangeFile(size, [*parts, (size - len(footer), footer)])
    return pq.ParquetFile(file, metadata=metadata, pre_buffer=False).read_row_group(group, columns=list(leaves))


def list_parquet(urls: str | Sequence[str], storage_options: dict | None, timeout: float | None,
                 retries: int | None) -> list[tuple[str, int]]:
    """``(url, size)`` of every Parquet file ``urls`` names: files, folders or bucket prefixes
    (every ``*.parquet`` under them, sorted by path), or glob patterns (``data/train-*.parquet``)."""
    found: list[tuple[str, int]] = []
    for url in [urls] if isinstance(urls, str) else list(urls):
        tries = listing.retries_for(retries, storage_options)
        with listing.opened(url, storage_options, timeout) as (fs, path):
            missing = f"{url}: no such Parquet file, folder or prefix"
            if any(char in path for char in GLOB_CHARS):
                infos = listing.with_retries(url, "listing", tries, missing, lambda: fs.glob(path, detail=True))
            elif path.endswith(".parquet"):
                infos = {path: listing.with_retries(url, "listing", tries, missing, lambda: fs.info(path))}
            else:
                infos = listing.with_retries(url, "listing", tries, missing, lambda: fs.find(path, detail=True))
            files = sorted((name, int(info["size"])) for name, info in infos.items()
                           if name.endswith(".parquet") and info.get("type", "file") == "file")
            if not files:
                raise FileNotFoundError(f"{url}: no .parquet file there")
            found.extend((listing.url_of(fs, name), size) for name, size in files)
    return found


def read_ranges(urls: Sequence[str], starts: Sequence[int], ends: Sequence[int], storage_options: dict | None,
                timeout: float | None, retries: int | None) -> list[bytes]:
    """The bytes of each range, fetched together (``cat_ranges``: concurrently on object stores)."""
    if not urls:
        return []
    tries = listing.retries_for(retries, storage_options)
    with listing.opened(urls[0], storage_options, timeout) as (fs, _):
        paths = [fs._strip_protocol(url) for url in urls]
        return listing.with_retries(urls[0], "reading", tries, f"{urls[0]} not found",
                                lambda: fs.cat_ranges(paths, list(starts), list(ends)))


def is_number(kind: Any) -> bool:
    """Whether a pyarrow type is numbers (integers, floats, booleans): a label, or a column
    delivered as a tensor."""
    import pyarrow as pa

    return pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)


def refuse_kind(name: str, kind: Any) -> TypeError:
    """The error for a label or ``columns=`` column of a type that cannot be one."""
    return TypeError(f"column {name!r} is {kind}: a label must be numbers, a batch field numbers, strings, a "
                     f"list of numbers, a list of equal-length lists of numbers, or a struct")


def is_text(kind: Any) -> bool:
    """Whether a pyarrow type is strings (plain, large, view, or dictionary-encoded): a column
    delivered as a list of ``str`` per batch rather than a tensor."""
    import pyarrow as pa

    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or getattr(pa.types, "is_string_view", bool)(kind)


def column_text(table: Any, name: str) -> Any:
    """A string column of ``table`` as one ``large_string`` Arrow array (nulls kept): compact
    (one buffer, not a Python object a row), and large offsets, so that the row groups of a big
    dataset concatenate past 2 GiB of text."""
    import pyarrow as pa

    return table.column(name).cast(pa.large_string()).combine_chunks()


def column_values(table: Any, name: str) -> tuple[np.ndarray, np.ndarray | None]:
    """A numeric column of ``table`` as a NumPy array (nulls as 0) and its null mask (None if no
    null); raises TypeError for a column that is not numbers."""
    import pyarrow as pa
    import pyarrow.compute as pc

    column = table.column(name)
    if not is_number(column.type):
        raise refuse_kind(name, column.type)
    nulls = None
    if column.null_count:
        nulls = np.asarray(pc.is_null(column).to_numpy(zero_copy_only=False), dtype=bool)
        column = pc.fill_null(column, pa.scalar(0, column.type) if not pa.types.is_boolean(column.type) else False)
    return np.asarray(column.to_numpy()), nulls
