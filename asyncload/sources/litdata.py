"""litdata's ``optimize()`` output (``index.json`` + ``chunk-0-0.bin`` ...), read as the writer
leaves it: a ``ChunkedSource`` (see ``chunked.py``) whose columns are the leaves of the sample's
pytree (``{"image": ..., "label": ...}`` -> columns ``image`` and ``label``; a nested dict's
leaves are ``outer.inner``; a tuple's ``0``, ``1``, ...), decoded by ``config.data_format``.

Our own reader of the published layout (litdata/streaming: ``PyTreeLoader``, ``writer.py``'s
``_create_chunk``). A chunk opens with ``uint32 n`` and ``uint32[n + 1]`` offsets, then holds
its items in one of the two layouts the writer chooses by what a sample's leaves are:

- **items** (a leaf is an image, an array, a tensor...: ``{"image": PIL image, "label": int}``):
  item ``i`` is bytes ``[offset[i], offset[i + 1])``, one ``uint32`` size per leaf then the
  leaves, each cut out and decoded by its ``data_format`` here;
- **Arrow rows** (a dict whose leaves are all str, int, float, bool, bytes, or lists and dicts of
  them: ``{"image": JPEG bytes, "label": int}``): every offset is the header's end, and the rows
  are an Arrow IPC file (a stream from older writers) at the chunk's end, followed by its
  ``uint32`` length and ``LDARW01\0``. Where that trailer is there, litdata's reader takes the
  rows from it, and so does this one: a sample is the row as pyarrow's ``to_pylist()`` gives it
  (nested lists and dicts as written). The rows of a chunk share one ranged read.

Compression: the Arrow rows' own compression (``optimize(compression="zstd")`` on such rows:
Arrow's zstd or lz4, inside the IPC file) is read, by pyarrow. litdata's zstd of the items
layout (``compression="zstd"`` with any ``compression_level``: whole ``.zstd.bin`` files, framed
batches, each item) is refused at construction, and so are encrypted chunks, another item loader
(token streams, Parquet), and, in the items layout, data formats not in ``column_decoder``
(``pickle``: unpickling runs code from the data; ``tensor`` and ``json``, whose byte layout
changes between litdata versions), each naming what it found.
"""

from __future__ import annotations

import json
import posixpath
import struct
from typing import Any, Callable, Sequence

import numpy as np

from ..redact import shown
from . import listing, shard_index
from .chunked import ChunkedSource, Column, array, pil_raw, raw, scalar, text
from .items import with_shared_docs

# litdata's _NUMPY_DTYPES_MAPPING (constants._NUMPY_SCTYPES): the dtype numbers of its numpy
# serializers, in full; the last four (objects, variable-size bytes and text, void) hold no
# fixed-size values to read and are refused by name (REFUSED_DTYPES)
NUMPY_DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32",
                "float64", "complex64", "complex128", "bool", "object", "bytes", "str", "void"]
REFUSED_DTYPES = ("object", "bytes", "str", "void")


def numpy_dtype(number: int) -> np.dtype:
    """The little-endian dtype of litdata's dtype ``number``; ValueError naming one not read."""
    name = NUMPY_DTYPES[number] if 0 <= number < len(NUMPY_DTYPES) else None
    if name is None or name in REFUSED_DTYPES:
        raise ValueError(f"numpy dtype number {number} ({name or 'unknown'}): asyncload reads arrays of "
                         f"{', '.join(n for n in NUMPY_DTYPES if n not in REFUSED_DTYPES)}")
    return np.dtype(name).newbyteorder("<")


def numpy_with_header(data: bytes) -> np.ndarray:
    """litdata's ``numpy``: ``uint32`` dtype number, ``uint32`` ndim, the shape, the values."""
    number, ndim = struct.unpack_from("<2I", data)
    shape = struct.unpack_from(f"<{ndim}I", data, 8)
    return np.frombuffer(data, numpy_dtype(number), offset=8 + 4 * ndim).reshape(shape)


def _bool(data: bytes) -> bool:
    return bool(data[0])


def column_decoder(data_format: str) -> Callable[[bytes], Any] | None:
    """How a leaf of ``data_format`` becomes a value (None: not supported)."""
    name, _, argument = data_format.partition(":")
    simple: dict[str, Callable[[bytes], Any]] = {
        "str": text, "text": text, "int": scalar("int64"), "float": scalar("float64"), "bytes": raw,
        "bool": _bool, "jpeg": raw, "image": raw, "pil": pil_raw, "numpy": numpy_with_header,
    }
    if name in simple:
        return simple[name]
    if name == "no_header_numpy" and argument.isdigit():
        return array(numpy_dtype(int(argument)).str)  # ValueError naming a dtype not read
    return None


def leaf_names(spec: Any, prefix: str = "") -> list[str]:
    """The names of a pytree's leaves, in flattening order, from litdata's ``data_spec``
    (``[version, {"type", "context", "children_spec"}]``, torch's treespec JSON)."""
    node = spec[1] if isinstance(spec, list) else spec
    children = node.get("children_spec") or []
    if node.get("type") is None and not children:
        return [prefix or "data"]
    kind = node.get("type") or ""
    keys = json.loads(node["context"]) if kind.endswith("dict") and node.get("context") else list(range(len(children)))
    names = []
    for key, child in zip(keys, children):
        names.extend(leaf_names(child, f"{prefix}.{key}" if prefix else str(key)))
    return names


# The trailer of a chunk whose rows are an Arrow IPC file (litdata's _ARROW_FOOTER_MAGIC), after
# the file's uint32 length: the last FOOTER_TAIL bytes of such a chunk
FOOTER_MAGIC = b"LDARW01\0"
FOOTER_TAIL = 12
# Leaf formats that keep every chunk in the items layout (the writer's _MEDIA_FORMAT_KEYS): a
# dataset with one of them has no Arrow rows, so its chunks' tails are not read
MEDIA_FORMATS = frozenset({"audio", "video", "image", "jpeg", "jpeg_array", "pil", "tiff", "text", "file", "mesh",
                           "pdf", "nifti", "graph", "tensor", "no_header_tensor", "no_header_numpy"})


def may_have_rows(formats: list[str]) -> bool:
    """Whether chunks of these leaf formats may hold Arrow rows (then each chunk's tail says)."""
    return all(name.split(":", 1)[0].lower() not in MEDIA_FORMATS for name in formats)


def arrow_rows(data: memoryview, first: int, rows: list[int], count: int) -> list[dict[str, Any]]:
    """Rows ``rows`` (numbers in the chunk) of the Arrow IPC file or stream ``data`` of a chunk
    of ``count`` rows, as litdata's reader gives them (``to_pylist()``)."""
    import pyarrow as pa

    source = pa.py_buffer(data)
    reader = pa.ipc.open_file(source) if bytes(data[:6]) == b"ARROW1" else pa.ipc.open_stream(source)
    table = reader.read_all()
    if table.num_rows != count:
        raise ValueError(f"its Arrow rows are {table.num_rows}, its index says {count} samples")
    low, high = min(rows) - first, max(rows) - first + 1  # a slice is free; to_pylist() is the one copy
    part = table.slice(low, high - low).to_pylist()
    return [part[row - first - low] for row in rows]


class LitdataSource(ChunkedSource):
    """The samples of a litdata ``optimize()`` dataset (see the module and ``ChunkedSource``):
    ``arrow_shards`` are the chunks whose samples are Arrow rows."""

    format_name = "litdata"

    def __init__(self, shards: Sequence[tuple[str, int | None, int]], columns: list[Column], *, index_url: str,
                 rows: bool, **options: Any) -> None:
        self.tail_bytes = FOOTER_TAIL if rows else 0
        self.arrow_shards: set[int] = set()
        super().__init__(shards, columns, **options)
        if len(self.arrow_shards) < len(self.urls):  # items to cut: every column must be read here
            for column in self.columns_read:
                if column.decode is None:
                    raise unsupported(index_url, column.name, column.encoding)
        if self.arrow_shards:
            try:
                import pyarrow  # noqa: F401
            except ImportError:
                raise ImportError(f"{index_url}: its chunks hold Arrow rows, read with pyarrow: pip install "
                                  "pyarrow (or asyncload[parquet])") from None

    def sample_ranges(self, shard: int, table: bytes, tail: bytes, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Every row of an Arrow rows chunk spans its IPC file (so its rows are read at once);
        an items chunk's samples are its offset table's ranges."""
        if len(tail) != FOOTER_TAIL or tail[-8:] != FOOTER_MAGIC:
            return super().sample_ranges(shard, table, tail, count)
        size = int(self.shard_bytes[shard])
        length = struct.unpack_from("<I", tail)[0]
        start = size - FOOTER_TAIL - length
        if length == 0 or start < 4 * (count + 2):
            raise ValueError(f"{self.urls[shard]}: its Arrow rows' length, {length} bytes, does not fit the "
                             f"chunk's {size} bytes after its offset table")
        self.arrow_shards.add(shard)
        return np.full(count, start, np.int64), np.full(count, size - FOOTER_TAIL, np.int64)

    def split_chunk(self, view: memoryview, base: int, indices: list[int]) -> dict[int, Any]:
        """Each sample of ``indices`` (all of one chunk) as ``{column: value}``: an items chunk's
        cut out (``ChunkedSource``), an Arrow rows chunk's rows from its IPC file; a chunk whose
        rows do not parse gives each sample its exception."""
        shard = int(self.shard_of[indices[0]])
        if shard not in self.arrow_shards:
            return super().split_chunk(view, base, indices)
        start, stop = int(self.sample_begin[indices[0]]) - base, int(self.sample_end[indices[0]]) - base
        first, count = int(self.shard_first[shard]), int(self.shard_first[shard + 1] - self.shard_first[shard])
        try:
            return dict(zip(indices, arrow_rows(view[start:stop], first, indices, count)))
        except Exception as error:  # the loader's SampleError names each sample
            return {index: error for index in indices}


def unsupported(index_url: str, name: str, data_format: str) -> ValueError:
    return ValueError(f"{index_url}: column {name!r} has data format {data_format!r}, which asyncload does not read "
                      "in litdata's items layout; supported: str, int, float, bool, bytes, jpeg, image, pil, numpy, "
                      "no_header_numpy (and in Arrow rows, what pyarrow reads)")


def columns_of(config: dict[str, Any], index_url: str) -> list[Column]:
    """The leaves as columns, each with its decoder; ValueError naming a column not supported.
    Where the chunks may hold Arrow rows (``may_have_rows``), a leaf format not read in the items
    layout gets ``decode=None``, refused later if a chunk has items."""
    if config.get("compression"):
        level = config.get("compression_level") or "chunk"
        raise ValueError(f"{index_url}: chunks written with compression={config['compression']!r} (compression_level "
                         f"{level!r}): asyncload reads litdata's items chunks without compression, and Arrow rows "
                         "chunks with or without theirs; write with optimize(compression=None)")
    if config.get("encryption"):
        raise ValueError(f"{index_url}: chunks written with encryption={config['encryption']!r}: asyncload reads "
                         "litdata chunks written without encryption")
    if config.get("item_loader", "PyTreeLoader") != "PyTreeLoader":
        raise ValueError(f"{index_url}: item_loader {config['item_loader']!r}: asyncload reads PyTreeLoader chunks")
    formats = config.get("data_format") or []
    names = leaf_names(json.loads(config["data_spec"])) if config.get("data_spec") else []
    if len(names) != len(formats):
        raise ValueError(f"{index_url}: data_spec has {len(names)} leaves, data_format {len(formats)}")
    columns = []
    for name, data_format in zip(names, formats):
        try:
            decode = column_decoder(data_format)
        except ValueError as error:
            raise ValueError(f"{index_url}: column {name!r} has data format {data_format!r}: {error}") from None
        if decode is None and not may_have_rows(formats):
            raise unsupported(index_url, name, data_format)
        columns.append(Column(name, data_format, decode, None))  # type: ignore[arg-type]
    return columns


def _items(chunk: Any, number: int, index_url: str) -> int:
    """Chunk ``number``'s ``chunk_size`` (its item count): an integer >= 0, or ValueError
    naming the chunk (``ChunkedSource`` checks it against the chunk's listed size)."""
    items = chunk.get("chunk_size") if isinstance(chunk, dict) else None
    if not shard_index.is_int(items) or items < 0:
        raise shard_index.index_error(index_url, number, None, "chunk_size", f"must be an integer >= 0, got {shown(items, 80)}")
    return items


@with_shared_docs
def litdata(url: str, storage_options: dict | None = None, *, image: str | None = None, label: str | None = None,
            timeout: float | None = None, retries: int | None = None, **options: Any) -> LitdataSource:
    """The samples of the litdata dataset at ``url`` (its ``index.json``, or the folder or bucket
    prefix ``optimize(output_dir=...)`` wrote), each reading as ``{column: value}``: ``jpeg``
    and ``image`` leaves as their encoded bytes, ``pil`` as an ``H x W x C`` uint8 array, the
    rest as Python values and NumPy arrays; a chunk of Arrow rows (samples whose leaves are all
    str, int, float, bool, bytes, lists and dicts: ``{"image": JPEG bytes, "label": int}``) as
    litdata's reader gives each row (see the module). Without ``decode=`` the loader gives
    ``(images, labels)``: ``image`` (default: the first jpeg/image leaf, else a bytes leaf named
    image or img) through ``ImageDecoder()``, ``label`` (default: a leaf named label, cls, class,
    target or y). The index and each chunk's offset table (and, where it may hold Arrow rows, its
    last 12 bytes) are read now, each request ending after ``timeout`` seconds, tried ``1 +
    retries`` times (as ``tar_shards``). ``options`` are ``ShardSource``'s: ``shuffle_buffer``,
    ``chunk_bytes``, ``cache_dir``, ``cache_bytes``.

    Args:
        url (str): the litdata dataset's ``index.json``, or the folder or bucket prefix holding it.
        {storage_options}
        image (str, optional): the image leaf the default decode decodes (default: the first
            image-encoded one).
        label (str, optional): the label leaf the default decode gives beside the images
            (default: one named label, labels, cls, class, target or y).
        {timeout and retries}
        **options: ``ShardSource``'s ``shuffle_buffer``, ``chunk_bytes``, ``cache_dir``,
            ``cache_bytes``.
    """
    index_url = shard_index.index_url(url)
    index = json.loads(listing.read_bytes(index_url, storage_options, timeout=timeout, retries=retries,
                                          what="litdata index"))
    if not isinstance(index, dict) or not isinstance(index.get("chunks"), list) or not isinstance(index.get("config"), dict):
        raise ValueError(f"{index_url}: not a litdata index (no 'chunks' and 'config')")
    columns = columns_of(index["config"], index_url)
    base = posixpath.dirname(index_url)
    # chunk_bytes is not the file's size in every litdata version: ChunkedSource lists the sizes
    shards = [(shard_index.shard_url(base, chunk.get("filename") if isinstance(chunk, dict) else None, number, False,
                                     "filename"), None, _items(chunk, number, index_url))
              for number, chunk in enumerate(index["chunks"])]
    return LitdataSource(shards, columns, index_url=index_url, rows=may_have_rows(index["config"].get("data_format") or []),
                         image=image, label=label, storage_options=storage_options, timeout=timeout, retries=retries,
                         **options)
