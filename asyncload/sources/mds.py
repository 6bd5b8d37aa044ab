"""MosaicML Streaming's MDS shards (``MDSWriter``'s ``index.json`` + ``shard.00000.mds`` ...), read
as the writer leaves them: a ``ChunkedSource`` (see ``chunked.py``) whose columns are the
index's ``column_names``, decoded by their ``column_encodings``.

Our own reader of the published layout (streaming/base/format/mds): a shard is an offset table
and samples; a sample is one ``uint32`` size per column without a fixed size, then the columns.
Refused at construction, naming the column or shard: ``pkl`` (unpickling runs code from the
data), compressed shards (``zip_data``), and encodings not listed in ``ENCODINGS``.
"""

from __future__ import annotations

import functools
import json
import posixpath
from typing import Any, Callable

import numpy as np

from ..redact import shown
from . import listing
from . import shard_index
from .shard_index import MAX_SHARD_BYTES, index_error, is_int
from .chunked import ChunkedSource, Column, pil_raw, raw, scalar, text
from .items import with_shared_docs

SCALARS = ("uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64", "float16", "float32", "float64")
# MDS's ndarray dtype codes (encodings.NDArray._int2value_dtype) and shape-size codes
NDARRAY_DTYPES = {8: "uint8", 9: "int8", 16: "uint16", 17: "int16", 18: "float16", 32: "uint32", 33: "int32",
                  34: "float32", 64: "uint64", 65: "int64", 66: "float64"}
SHAPE_DTYPES = {0: "uint8", 1: "uint16", 2: "uint32", 3: "uint64"}


def ndarray(spec: str) -> Callable[[bytes], np.ndarray]:
    """MDS's ``ndarray[:dtype[:shape]]``: the dtype and shape from the encoding when fixed, else
    from the value's own small header (a dtype byte; an ``ndim << 2 | shape size`` byte and the
    shape)."""
    parts = spec.split(":")[1:]
    fixed_dtype = parts[0] if parts and parts[0] else None
    if fixed_dtype is not None and fixed_dtype not in NDARRAY_DTYPES.values():
        raise ValueError(f"{fixed_dtype!r} is not one of MDS's ndarray dtypes ({', '.join(NDARRAY_DTYPES.values())})")
    dims = parts[1].split(",") if len(parts) > 1 else None
    if len(parts) > 2 or (dims is not None and not all(dim.isdigit() for dim in dims)):
        raise ValueError(f"the shape {':'.join(parts[1:])!r} is not sizes separated by commas (as in ndarray:int16:3,4)")
    fixed_shape = tuple(int(dim) for dim in dims) if dims is not None else None
    return functools.partial(_ndarray, fixed_dtype, fixed_shape)


def _ndarray(dtype: str | None, shape: tuple[int, ...] | None, data: bytes) -> np.ndarray:
    position = 0
    if dtype is None:
        dtype, position = NDARRAY_DTYPES[data[0]], 1
    if shape is None:
        ndim, code = data[position] >> 2, data[position] & 3
        kind = np.dtype(SHAPE_DTYPES[code]).newbyteorder("<")
        shape = tuple(np.frombuffer(data, kind, ndim, position + 1).tolist())
        position += 1 + ndim * kind.itemsize
    return np.frombuffer(data, np.dtype(dtype).newbyteorder("<"), offset=position).reshape(shape)


def _str_int(data: bytes) -> int:
    return int(data.decode("utf-8"))


def _str_float(data: bytes) -> float:
    return float(data.decode("utf-8"))


def column_decoder(encoding: str) -> Callable[[bytes], Any] | None:
    """How a column of ``encoding`` becomes a value (None: not supported)."""
    name = encoding.split(":")[0]
    simple: dict[str, Callable[[bytes], Any]] = {
        "bytes": raw, "str": text, "int": scalar("int64"), "json": json.loads,
        "jpeg": raw, "png": raw, "pil": pil_raw,
        "str_int": _str_int, "str_float": _str_float,
    }
    if name in simple:
        return simple[name]
    if name in SCALARS:
        return scalar(name)
    if name == "ndarray":
        return ndarray(encoding)
    return None


class MDSSource(ChunkedSource):
    """The samples of an MDS dataset (see the module and ``ChunkedSource``)."""

    format_name = "mds"


MAX_MDS_BYTES = 1 << 32  # the offset table's entries are uint32: no MDS shard is larger


def checked_counts(shard: dict[str, Any], number: int, index_url: str) -> tuple[int, int]:
    """Shard ``number``'s ``(bytes, samples)``, checked before anything is allocated from them
    (a hostile or corrupt index may say 2**34 samples): ValueError naming the shard and field.
    ``ChunkedSource`` then checks ``bytes`` against the listed size."""
    size, samples = shard["raw_data"].get("bytes"), shard.get("samples")
    if not is_int(size) or not 0 <= size <= min(MAX_MDS_BYTES, MAX_SHARD_BYTES):
        raise index_error(index_url, number, None, "raw_data.bytes", f"must be an integer in [0, 2**32], got {shown(size, 80)}")
    if not is_int(samples) or not 0 < samples <= (size - 8) // 4:
        raise index_error(index_url, number, None, "samples", f"must be an integer in [1, {max(0, (size - 8) // 4)}] "
                   f"(its offset table fits its {size} bytes), got {shown(samples, 80)}")
    return size, samples


def columns_of(shard: dict[str, Any], number: int, url: str) -> list[Column]:
    """A shard's columns, each with its decoder; ValueError naming a column not supported, or
    column lists that do not match."""
    names, encodings, sizes = shard.get("column_names"), shard.get("column_encodings"), shard.get("column_sizes")
    if not all(isinstance(field, list) for field in (names, encodings, sizes)) or not len(names) == len(encodings) == len(sizes):
        raise index_error(url, number, None, "column_names", "column_names, column_encodings and column_sizes must be lists "
                   f"of one entry per column, got {shown(names, 60)}, {shown(encodings, 60)}, {shown(sizes, 60)}")
    for field, values, valid in (("column_names", names, lambda v: isinstance(v, str)),
                                 ("column_encodings", encodings, lambda v: isinstance(v, str)),
                                 ("column_sizes", sizes, lambda v: v is None or (is_int(v) and v >= 0))):
        wrong = [value for value in values if not valid(value)]
        if wrong:
            raise index_error(url, number, None, field, f"has an entry {shown(wrong[0], 80)}: names and encodings are "
                       "strings, sizes null or integers >= 0")
    columns = []
    for name, encoding, size in zip(names, encodings, sizes):
        try:
            decode = column_decoder(encoding)
        except ValueError as error:
            raise ValueError(f"{url}: shard {number}: column {name!r} has encoding {encoding!r}: {error}") from error
        if decode is None:
            why = "unpickling runs code from the data" if encoding == "pkl" else "an encoding asyncload does not read"
            raise ValueError(f"{url}: column {name!r} has encoding {encoding!r}: {why}; supported: bytes, str, int, json, "
                             f"jpeg, png, pil, str_int, str_float, ndarray, {', '.join(SCALARS)}")
        columns.append(Column(name, encoding, decode, size))
    return columns


@with_shared_docs
def mds(url: str, storage_options: dict | None = None, *, image: str | None = None, label: str | None = None,
        timeout: float | None = None, retries: int | None = None, **options: Any) -> MDSSource:
    """The samples of the MDS dataset at ``url`` (its ``index.json``, or the folder or bucket
    prefix that holds one), each reading as ``{column: value}``: ``jpeg``/``png`` columns as
    their encoded bytes, ``pil`` as an ``H x W x C`` uint8 array, ``str``/``json``/numbers/
    ``ndarray``/``bytes`` as Python values and NumPy arrays. Without ``decode=`` the loader gives
    ``(images, labels)``: ``image`` (default: the first jpeg/png column) through
    ``ImageDecoder()``, ``label`` (default: a column named label, cls, class, target or y).
    The index and each shard's offset table are read now; each request ends after ``timeout``
    seconds, tried ``1 + retries`` times (as ``tar_shards``). ``options`` are ``ShardSource``'s:
    ``shuffle_buffer``, ``chunk_bytes``, ``cache_dir``, ``cache_bytes``.

    Args:
        url (str): the MDS dataset's ``index.json``, or the folder or bucket prefix holding it.
        {storage_options}
        image (str, optional): the image column the default decode decodes (default: the first
            image-encoded one).
        label (str, optional): the label column the default decode gives beside the images
            (default: one named label, labels, cls, class, target or y).
        {timeout and retries}
        **options: ``ShardSource``'s ``shuffle_buffer``, ``chunk_bytes``, ``cache_dir``,
            ``cache_bytes``.
    """
    index_url = shard_index.index_url(url)
    index = json.loads(listing.read_bytes(index_url, storage_options, timeout=timeout, retries=retries, what="MDS index"))
    base = posixpath.dirname(index_url)
    shards, columns = [], None
    named: dict[str, int] = {}  # the shard that names each file
    for number, shard in enumerate(index.get("shards", []) if isinstance(index, dict) else []):
        if not isinstance(shard, dict) or shard.get("format") != "mds":
            raise ValueError(f"{index_url}: shard {number} is not an MDS shard (format {str(shard.get('format'))[:40]!r})"
                             if isinstance(shard, dict) else f"{index_url}: shard {number} is not an object")
        if shard.get("compression") or not isinstance(shard.get("raw_data"), dict):
            raise ValueError(f"{index_url}: shard {number} is compressed ({shard.get('compression')}): "
                             "asyncload reads uncompressed MDS shards (MDSWriter(compression=None))")
        declared, samples = checked_counts(shard, number, index_url)
        found = columns_of(shard, number, index_url)
        if columns is not None and [(c.name, c.encoding, c.size) for c in found] != [(c.name, c.encoding, c.size) for c in columns]:
            raise ValueError(f"{index_url}: shard {number}'s columns differ from shard 0's")
        columns = found
        url_of_shard = shard_index.shard_url(base, shard["raw_data"].get("basename"), number, False, "raw_data.basename")
        file = posixpath.normpath(shard["raw_data"]["basename"])  # a str now (shard_url checked it)
        if file in named:  # Streaming reads such an index's shard twice: its samples would come twice an epoch
            raise ValueError(f"{index_url}: shards {named[file]} and {number} both name the file "
                             f"{shown(shard['raw_data'].get('basename'), 120)}: its samples would come twice an "
                             "epoch; remove the repeated entry from the index")
        named[file] = number
        shards.append((url_of_shard, declared, samples))
    if columns is None:
        raise ValueError(f"{index_url}: an MDS index with no shards")
    return MDSSource(shards, columns, image=image, label=label, storage_options=storage_options,
                     timeout=timeout, retries=retries, **options)
