"""Shard sets whose shards open with a table of sample offsets: MosaicML Streaming's MDS shards
and litdata's ``optimize()`` chunks, read as their writers leave them.

Both writers lay a shard out the same way: ``uint32 n``, then ``uint32[n + 1]`` absolute byte
offsets (sample ``i`` is bytes ``[offset[i], offset[i + 1])``), then the samples; a sample is a
header of ``uint32`` sizes (one per column whose size is not fixed) followed by the columns'
bytes in order. So the byte range of every sample is known from each shard's first
``4 * (n + 2)`` bytes: those are read up front (one small ranged read per shard, all at once),
and from then on this is a ``ShardSource`` like ``tar_shards``: the same order, ranged chunked
reads, shuffle buffer, ranks, resume, ``processes=N``, ``cache_dir`` and ``mix``.

What differs is how a read's bytes become a sample (``split_chunk``): the columns are cut out of
the sample and turned into Python values here (numbers, text, JSON, NumPy arrays: cheap), while
an encoded image (JPEG, PNG) stays bytes for ``decode`` to decode on a decode thread, where it
releases the GIL. A sample reads as ``{column: value}``.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ..decode.members import Members
from ..decode.names import LABEL_NAMES, is_image
from .parquet_files import read_ranges
from .shards import ShardSample, ShardSource
from .items import checked_index



@dataclass(frozen=True)
class Column:
    """One column of a sample: its name, its encoding (as the writer named it), how its bytes
    become a value, and its fixed size in bytes (None: the sample's header gives it)."""

    name: str
    encoding: str
    decode: Callable[[bytes], Any]
    size: int | None = None


class ChunkedSource(ShardSource):
    """The samples of MDS or litdata shards as ``ShardSample`` items, each reading as a dict
    ``{column: value}`` (see the module). Build it with ``mds(url)`` or ``litdata(url)``.

    Without ``decode=``, the loader decodes the image column (``image``, the first image-encoded
    column by default) with ``ImageDecoder()`` and gives the label column (``label``: a column
    named label, cls, class, target or y, if any) beside it: batches of ``(images, labels)``."""

    format_name = "chunked"
    tail_bytes = 0  # how many of each shard's last bytes ``sample_ranges`` is given (litdata: 12)

    def __init__(self, shards: Sequence[tuple[str, int | None, int]], columns: Sequence[Column], *,
                 image: str | None = None, label: str | None = None, storage_options: dict | None = None,
                 shuffle_buffer: int = 1000, chunk_bytes: int = 16 << 20, cache_dir: str | None = None,
                 cache_bytes: int | None = None, timeout: float | None = None, retries: int | None = None) -> None:
        self._settings(storage_options, "all", shuffle_buffer, chunk_bytes, cache_dir, cache_bytes)
        self.classes: list[str] = []
        self.labels = None
        self.columns_read = list(columns)
        self.header_columns = sum(1 for column in self.columns_read if column.size is None)
        self.image, self.label = self._pick(image, label)
        shards = [shard for shard in shards if shard[2] > 0]
        self.urls = [url for url, _, _ in shards]
        self.shard_bytes = self._listed_sizes([declared for _, declared, _ in shards], timeout, retries)
        counts = np.array([samples for _, _, samples in shards], dtype=np.int64)
        for url, count, size in zip(self.urls, counts.tolist(), self.shard_bytes.tolist()):
            if 4 * (count + 2) > size:  # before anything is allocated per sample
                raise ValueError(f"{url}: its index says {count} samples, more than the offset table of a "
                                 f"{size}-byte shard can hold")
        self.shard_of = np.repeat(np.arange(len(shards), dtype=np.int32), counts)
        self.shard_first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._read_offsets(counts, timeout, retries)

    def _pick(self, image: str | None, label: str | None) -> tuple[str | None, str | None]:
        names = [column.name for column in self.columns_read]
        for name in (image, label):
            if name is not None and name not in names:
                raise ValueError(f"{self.format_name}: no column {name!r} (columns: {', '.join(names)})")
        if image is None:  # an image-encoded column, else raw bytes named as images are (litdata's Arrow rows)
            image = next((c.name for c in self.columns_read if is_image(c.encoding.split(":")[0])), None) or next(
                (c.name for c in self.columns_read if c.encoding == "bytes" and is_image(c.name)), None)
        if label is None:
            label = next((name for name in LABEL_NAMES if name in names), None)
        return image, label

    def _listed_sizes(self, declared: list[int | None], timeout: float | None, retries: int | None) -> np.ndarray:
        """Each shard's size from one listing of its folder, not from the index: litdata's
        ``chunk_bytes`` is the file's size in some versions and its items' bytes (without the
        offset table) in others. A size the index declares (MDS) may not exceed the listed one."""
        from .shard_learn import sizes_of

        listed = sizes_of(self.urls, self.storage_options, timeout, retries) if self.urls else []
        for url, size, found in zip(self.urls, declared, listed):
            if size is not None and size > found:
                raise ValueError(f"{url}: its index says {size} bytes, the storage holds {found}")
        return np.array(listed, dtype=np.int64)

    def _read_offsets(self, counts: np.ndarray, timeout: float | None, retries: int | None) -> None:
        """Every sample's byte range, from each shard's offset table (one ranged read a shard)
        and, for a source whose shards may end with a trailer (``tail_bytes``), their last bytes."""
        ends = (4 * (counts + 2)).tolist()
        tables = read_ranges(self.urls, [0] * len(self.urls), ends, self.storage_options, timeout, retries)
        sizes = self.shard_bytes.tolist()
        tails = (read_ranges(self.urls, [max(0, size - self.tail_bytes) for size in sizes], sizes,
                             self.storage_options, timeout, retries) if self.tail_bytes else [b""] * len(self.urls))
        begin, end = [], []
        for shard, (url, table, tail, count, size) in enumerate(zip(self.urls, tables, tails, counts.tolist(), sizes)):
            if len(table) < 4 * (count + 2) or struct.unpack_from("<I", table)[0] != count:
                found = struct.unpack_from("<I", table)[0] if len(table) >= 4 else "nothing"
                raise ValueError(f"{url}: its index says {count} samples, the shard's header says {found}")
            first, last = self.sample_ranges(shard, table, tail, count)
            begin.append(first)
            end.append(last)
        self.sample_begin = np.concatenate(begin) if begin else np.zeros(0, np.int64)
        self.sample_end = np.concatenate(end) if end else np.zeros(0, np.int64)

    def sample_ranges(self, shard: int, table: bytes, tail: bytes, count: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``[begin, end)`` byte range of each of shard ``shard``'s ``count`` samples, from its
        offset table ``table`` (and its last ``tail_bytes`` bytes, ``tail``); ValueError naming
        the shard where the table is not in order or runs past the shard."""
        url, size = self.urls[shard], int(self.shard_bytes[shard])
        offsets = np.frombuffer(table, dtype="<u4", offset=4, count=count + 1).astype(np.int64)
        if offsets[0] < 4 * (count + 2) or np.any(np.diff(offsets) < 4 * self.header_columns) or offsets[-1] > size:
            raise ValueError(f"{url}: its offset table is not in order or runs past the shard's {size} bytes")
        return offsets[:-1], offsets[1:]

    def __len__(self) -> int:
        return int(self.shard_first[-1])

    def __getitem__(self, index: int) -> Any:  # type: ignore[override]
        index = checked_index(index, len(self), type(self).__name__)
        shard = int(self.shard_of[index])
        return ShardSample(self.urls[shard], str(index - int(self.shard_first[shard])), index)

    def __repr__(self) -> str:
        names = ", ".join(f"{c.name}:{c.encoding}" for c in self.columns_read)
        return f"{type(self).__name__}({len(self)} samples in {len(self.urls)} shards; {names})"

    def split_chunk(self, view: memoryview, base: int, indices: list[int]) -> dict[int, Any]:
        """Each sample of ``indices`` as ``{column: value}``, cut from ``view`` (its shard's bytes
        from ``base`` on); a sample whose bytes do not parse gets its exception instead."""
        out: dict[int, Any] = {}
        for index in indices:
            start, stop = int(self.sample_begin[index]) - base, int(self.sample_end[index]) - base
            try:
                out[index] = self.parse(bytes(view[start:stop]))
            except Exception as error:  # the loader's SampleError names the sample
                out[index] = error
        return out

    def parse(self, data: bytes) -> dict[str, Any]:
        """One sample's bytes -> ``{column: value}``."""
        sizes = iter(struct.unpack_from(f"<{self.header_columns}I", data))
        position = 4 * self.header_columns
        sample = {}
        for column in self.columns_read:
            size = column.size if column.size is not None else next(sizes)
            if position + size > len(data):
                raise ValueError(f"column {column.name!r} runs past the sample's {len(data)} bytes")
            try:
                sample[column.name] = column.decode(data[position:position + size])
            except Exception as error:
                raise ValueError(f"column {column.name!r} ({column.encoding}): {error}") from error
            position += size
        return sample

    def default_decode(self) -> Members:
        """What the loader decodes a sample with when no ``decode=`` is given: the image column
        through ``ImageDecoder()``, and the label column beside it (see the class)."""
        if self.image is None:
            raise ValueError(f"{self!r} has no image column: pass a decode= for its samples ({{column: value}})")
        fields = (self.image,) if self.label is None else (self.image, self.label)
        return Members(*fields, images=(self.image,))


def scalar(dtype: str) -> Callable[[bytes], Any]:
    """A decoder of one little-endian number of ``dtype`` to a Python int or float (a partial
    of a module function, not a closure: a source must pickle for ``processes=N``)."""
    return functools.partial(_number, np.dtype(dtype).newbyteorder("<"))


def _number(kind: np.dtype, data: bytes) -> Any:
    return np.frombuffer(data, kind, count=1)[0].item()


def array(dtype: str) -> Callable[[bytes], np.ndarray]:
    """A decoder of a flat little-endian array of ``dtype``."""
    return functools.partial(np.frombuffer, dtype=np.dtype(dtype).newbyteorder("<"))


def text(data: bytes) -> str:
    return data.decode("utf-8")


def raw(data: bytes) -> bytes:
    return data


def pil_raw(data: bytes) -> np.ndarray:
    """Pillow's raw pixels as both writers store them (``width, height, len(mode)`` as uint32,
    the mode, the pixels) -> an ``H x W (x C)`` uint8 array; only 8-bit modes."""
    width, height, mode_size = struct.unpack_from("<3I", data)
    mode = data[12:12 + mode_size].decode("ascii")
    channels = {"L": 1, "P": 1, "RGB": 3, "RGBA": 4, "CMYK": 4, "LA": 2}.get(mode)
    if channels is None:
        raise ValueError(f"raw image mode {mode!r} is not an 8-bit mode (L, RGB, RGBA, CMYK, LA, P)")
    pixels = np.frombuffer(data, np.uint8, offset=12 + mode_size).reshape(height, width, channels)
    return pixels[:, :, 0] if channels == 1 else pixels
