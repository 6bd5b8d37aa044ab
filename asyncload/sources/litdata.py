"""litdata's ``optimize()`` output (``index.json`` + ``chunk-0-0.bin`` ...), read as the writer
leaves it: a ``ChunkedSource`` (see ``chunked.py``) whose columns are the leaves of the sample's
pytree (``{"image": ..., "label": ...}`` -> columns ``image`` and ``label``; a nested dict's
leaves are ``outer.inner``; a tuple's ``0``, ``1``, ...), decoded by ``config.data_format``.

Our own reader of the published layout (litdata/streaming: ``PyTreeLoader``): a chunk is an
offset table and items; an item is one ``uint32`` size per leaf, then the leaves. Refused at
construction, naming the column: compressed or encrypted chunks, another item loader (token
streams), and data formats not in ``column_decoder`` (``pickle``: unpickling runs code from the
data; ``tensor`` and ``json``, whose byte layout changes between litdata versions).
"""

from __future__ import annotations

import json
import posixpath
import struct
from typing import Any, Callable

import numpy as np

from ..redact import shown
from . import listing, shard_index
from .chunked import ChunkedSource, Column, array, pil_raw, raw, scalar, text
from .items import _shared_docs

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


class LitdataSource(ChunkedSource):
    """The samples of a litdata ``optimize()`` dataset (see the module and ``ChunkedSource``)."""

    format_name = "litdata"


def columns_of(config: dict[str, Any], index_url: str) -> list[Column]:
    """The leaves as columns, each with its decoder; ValueError naming a column not supported."""
    for what in ("compression", "encryption"):
        if config.get(what):
            raise ValueError(f"{index_url}: chunks written with {what}={config[what]!r}: asyncload reads "
                             f"litdata chunks written without {what}")
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
        if decode is None:
            raise ValueError(f"{index_url}: column {name!r} has data format {data_format!r}, which asyncload does not "
                             "read; supported: str, int, float, bool, bytes, jpeg, image, pil, numpy, no_header_numpy")
        columns.append(Column(name, data_format, decode, None))
    return columns


def _items(chunk: Any, number: int, index_url: str) -> int:
    """Chunk ``number``'s ``chunk_size`` (its item count): an integer >= 0, or ValueError
    naming the chunk (``ChunkedSource`` checks it against the chunk's listed size)."""
    items = chunk.get("chunk_size") if isinstance(chunk, dict) else None
    if not shard_index._is_int(items) or items < 0:
        raise shard_index._bad(index_url, number, None, "chunk_size", f"must be an integer >= 0, got {shown(items, 80)}")
    return items


@_shared_docs
def litdata(url: str, storage_options: dict | None = None, *, image: str | None = None, label: str | None = None,
            timeout: float | None = None, retries: int | None = None, **options: Any) -> LitdataSource:
    """The samples of the litdata dataset at ``url`` (its ``index.json``, or the folder or bucket
    prefix ``optimize(output_dir=...)`` wrote), each reading as ``{column: value}``: ``jpeg``
    and ``image`` leaves as their encoded bytes, ``pil`` as an ``H x W x C`` uint8 array, the
    rest as Python values and NumPy arrays. Without ``decode=`` the loader gives ``(images,
    labels)``: ``image`` (default: the first jpeg/image leaf) through ``ImageDecoder()``,
    ``label`` (default: a leaf named label, cls, class, target or y). The index and each chunk's
    offset table are read now, each request ending after ``timeout`` seconds, tried ``1 +
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
    return LitdataSource(shards, columns, image=image, label=label, storage_options=storage_options,
                         timeout=timeout, retries=retries, **options)
