"""Writing shard sets (a folder or a manifest -> tar shards + ``index.json``) and indexing shards
written by other tools (WebDataset's ``tarwriter``, ``tar`` itself); and a Parquet file from any
source (``write_parquet``).

The index records each member's byte range inside its shard, so the loader reads shards with
ranged requests and never parses tar headers on the hot path.
"""

from __future__ import annotations

import io
import json
import posixpath
import tarfile
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterator, Sequence

from fsspec.core import split_protocol

from ..decode.names import LABEL_MEMBER
from ..io import object_store
from ..redact import shown
from .parquet_files import pyarrow_parquet
from .shard_index import INDEX_FORMAT, INDEX_NAME

READ_BATCH = 64  # files fetched at once while writing
MAX_LABEL_BYTES = 64  # a .cls member holds a class number: read no more of it
TAR_ENDED = ("end of data", "empty header", "truncated header", "empty file")  # tarfile's words: the bytes ended


def write_shards(
    source: Sequence[Any],
    url: str,
    *,
    samples_per_shard: int = 1000,
    storage_options: dict | None = None,
    name: str = "shard-{:06d}.tar",
) -> str:
    """Writes the items of ``source`` (URLs, or ``(url, label)`` pairs, e.g. from
    ``image_folder`` or ``manifest``) as tar shards of ``samples_per_shard`` samples under ``url``
    (a folder or bucket prefix), each sample ``<key>.<ext>`` plus ``<key>.cls`` for its label, and
    the shards' ``index.json``. Keys are the items' positions in ``source``. Returns the index URL.
    Object stores are read and written through the loader's client (``object_store``)."""
    if samples_per_shard < 1:
        raise ValueError(f"samples_per_shard must be at least 1, got {samples_per_shard}")
    with Clients(storage_options or {}) as clients:
        out_fs, root = clients.for_url(url)
        out_fs.makedirs(root, exist_ok=True)
        shards = []
        for number, start in enumerate(range(0, len(source), samples_per_shard)):
            items = [source[i] for i in range(start, min(start + samples_per_shard, len(source)))]
            shard_name = name.format(number)
            with out_fs.open(posixpath.join(root, shard_name), "wb") as file:
                shards.append({"url": shard_name, **_write_shard(file, items, start, clients)})
        index = {"format": INDEX_FORMAT, "classes": list(getattr(source, "classes", [])), "shards": shards}
        out_fs.pipe_file(posixpath.join(root, INDEX_NAME), json.dumps(index).encode())
    return posixpath.join(url.rstrip("/"), INDEX_NAME)


class Clients:
    """The filesystems of one ``write_shards``/``index_shards`` call, one per protocol (each
    object-store client keeps a connection pool: building one per shard or per item would
    redo its connections), and the threads that read items (on threads, ``READ_BATCH`` at a
    time: a bucket's latency, not its bandwidth, bounds one read at a time)."""

    def __init__(self, options: dict) -> None:
        self.options = options
        self._filesystems: dict[str, Any] = {}
        self._pool = ThreadPoolExecutor(READ_BATCH, thread_name_prefix="asyncload-write-shards")

    def for_url(self, url: str) -> tuple[Any, str]:
        """The filesystem for ``url`` and the path in it (filesystems built on the caller's thread)."""
        protocol = split_protocol(url)[0] or "file"
        if protocol not in self._filesystems:
            self._filesystems[protocol] = object_store.url_to_fs(url, self.options)[0]
        fs = self._filesystems[protocol]
        return fs, fs._strip_protocol(url)

    def read_all(self, urls: list[str]) -> Iterator[bytes]:
        """The bytes at each URL, in order; at most ``READ_BATCH`` read or held at once."""
        reads: deque[Future] = deque()
        for url in urls:
            fs, path = self.for_url(url)
            reads.append(self._pool.submit(fs.cat_file, path))
            if len(reads) == READ_BATCH:
                yield reads.popleft().result()
        while reads:
            yield reads.popleft().result()

    def __enter__(self) -> "Clients":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._pool.shutdown(cancel_futures=True)
        for fs in self._filesystems.values():
            object_store.release(fs)


def _write_shard(file: Any, items: list[Any], first_key: int, clients: Clients) -> dict[str, Any]:
    """Writes one tar of ``items``; returns its index entry (without the URL)."""
    keys, members, labels = [], [], []
    urls = [item[0] if isinstance(item, (tuple, list)) else item for item in items]
    with tarfile.open(fileobj=file, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for offset, (item, data) in enumerate(zip(items, clients.read_all(urls))):
            url, label = item if isinstance(item, (tuple, list)) else (item, None)
            key = f"{first_key + offset:08d}"
            ext = posixpath.splitext(url)[1].lstrip(".").lower() or "bin"
            entry = [_add(tar, f"{key}.{ext}", data)]
            if label is not None:
                entry.append(_add(tar, f"{key}.{LABEL_MEMBER}", str(int(label)).encode()))
            keys.append(key)
            members.append(entry)
            labels.append(None if label is None else int(label))
    return {"bytes": file.tell(), "keys": keys, "members": members,
            "labels": labels if all(label is not None for label in labels) else None}


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> list[Any]:
    """Adds a member; returns ``[extension, data offset, size]`` (the data ends the padded
    blocks that ``addfile`` just wrote)."""
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))
    padded = -(-len(data) // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
    return [name.split(".", 1)[1], tar.offset - padded, len(data)]


def index_shards(urls: Sequence[str], out: str | None = None, *, storage_options: dict | None = None,
                 classes: Sequence[str] = ()) -> str:
    """Indexes existing WebDataset-style shards (``urls``): one streaming pass over each, reading
    only the small ``.cls`` members' contents. A member ``dir/key.ext`` belongs to sample
    ``dir/key`` (the part of the name before its first dot). Writes ``index.json`` to ``out``
    (default: beside the first shard) and returns its URL. Shards in ``out``'s folder (or below)
    are recorded relative to it; others by their URL, which ``tar_shards`` reads only with
    ``allow_external_shards=True``. A GNU sparse member (``tar --sparse``) is refused, unread."""
    out = out or posixpath.join(posixpath.dirname(urls[0]), INDEX_NAME)
    base = posixpath.dirname(out)
    shards = []
    with Clients(storage_options or {}) as clients:
        for url in urls:
            fs, path = clients.for_url(url)
            with fs.open(path, "rb") as file:
                entry = index_shard(file, url)
            entry["bytes"] = fs.size(path)
            inside = url.startswith(base.rstrip("/") + "/") and ".." not in url.split("/")
            relative = posixpath.relpath(url, base) if inside else url
            shards.append({"url": relative, **entry})
        index = {"format": INDEX_FORMAT, "classes": list(classes), "shards": shards}
        out_fs, out_path = clients.for_url(out)
        out_fs.pipe_file(out_path, json.dumps(index).encode())
    return out


def index_shard(file: Any, url: str) -> dict[str, Any]:
    """One shard's index entry from one streaming pass over its tar ``file``. A member's
    extension is lower-cased (``a.JPG`` is ``jpg``) and a sample with two members of one
    extension is refused, as WebDataset's ``group_by_keys`` does; a tar cut short (or not a tar)
    is a ValueError naming the shard and the byte where it ends, not a read error."""
    keys: list[str] = []
    members: list[list[list[Any]]] = []
    labels: list[int | None] = []
    seen: set[str] = set()
    names: dict[str, str] = {}  # the current sample's members, by extension
    counted = _Counted(file)
    tar: tarfile.TarFile | None = None
    member: tarfile.TarInfo | None = None
    try:
        with tarfile.open(fileobj=counted, mode="r|") as tar:
            for member in tar:
                if member.issparse():  # before isfile(): a sparse member is a file too
                    raise ValueError(f"{url}: member {shown(member.name, 80)} is a GNU sparse file: what the tar "
                                     "holds is not its content, so no byte range reads it; repack the shard without "
                                     "--sparse")
                if not member.isfile():
                    continue
                directory, base = posixpath.split(member.name)
                if "." not in base:
                    continue
                stem, ext = base.split(".", 1)
                ext = ext.lower()  # WebDataset's group_by_keys lower-cases the suffix (lcase=True)
                key = posixpath.join(directory, stem)
                if not keys or keys[-1] != key:  # a sample's members are consecutive in a shard
                    if key in seen:
                        raise ValueError(f"{url}: the members of sample {shown(key, 80)} are not consecutive in "
                                         f"the shard ({shown(member.name, 80)} comes after another sample's): "
                                         "WebDataset shards keep a sample's members together; rewrite the shard so")
                    seen.add(key)
                    keys.append(key)
                    members.append([])
                    labels.append(None)
                    names = {}
                if ext in names:
                    raise ValueError(f"{url}: sample {shown(key, 80)} has two {ext!r} members, "
                                     f"{shown(names[ext], 80)} and {shown(member.name, 80)} (extensions compared "
                                     "lower-cased): WebDataset refuses such a shard too (duplicate file name in tar "
                                     "file); keep one of them")
                names[ext] = member.name
                members[-1].append([ext, member.offset_data, member.size])
                if ext == LABEL_MEMBER:
                    labels[-1] = _label(tar, member, url)
    except tarfile.TarError as error:
        raise _cut_short(url, counted.read_bytes, member, tar, error) from error
    if tar is not None and counted.read_bytes < tar.offset + tarfile.BLOCKSIZE:
        # tarfile ends quietly where a header should be but the bytes end: a whole tar has one
        # there (or its end-of-archive blocks), so what follows was cut off
        raise _cut_short(url, counted.read_bytes, member, tar, None)
    return {"keys": keys, "members": members,
            "labels": labels if all(label is not None for label in labels) else None}


class _Counted:
    """A file read forward (all a streaming ``tarfile`` asks of it), counting the bytes it gave:
    where the shard's bytes end, when a tar is cut short."""

    def __init__(self, file: Any) -> None:
        self.file = file
        self.read_bytes = 0

    def read(self, size: int = -1) -> bytes:
        data = self.file.read(size)
        self.read_bytes += len(data)
        return data


def _cut_short(url: str, size: int, member: tarfile.TarInfo | None, tar: tarfile.TarFile | None,
               error: tarfile.TarError | None) -> ValueError:
    """What a tar that ends early (or is not a tar past some byte) says: the shard, the byte
    where its data ends and the member it ends in or after."""
    offset = tar.offset if tar is not None else 0  # where tarfile looked for the next header
    if error is not None and not any(words in str(error) for words in TAR_ENDED):
        after = f", after member {shown(member.name, 80)}" if member is not None else ""
        return ValueError(f"{url}: not a tar at byte {offset}{after} ({error})")
    if member is not None and size < member.offset_data + member.size:
        where = (f"inside member {shown(member.name, 80)} (its data is bytes {member.offset_data} to "
                 f"{member.offset_data + member.size})")
    elif member is not None:
        where = f"after member {shown(member.name, 80)}, where a header or the end-of-archive blocks belong"
    else:
        where = "inside its first header"
    return ValueError(f"{url}: the tar is cut short: its bytes end at byte {size}, {where}; a partial upload "
                      "or copy? write the shard again")


def _label(tar: tarfile.TarFile, member: tarfile.TarInfo, url: str) -> int:
    """The class number a ``.cls`` member holds; read no further than ``MAX_LABEL_BYTES``."""
    extracted = tar.extractfile(member)
    data = extracted.read(MAX_LABEL_BYTES + 1) if extracted is not None else b""
    try:
        if len(data) > MAX_LABEL_BYTES:
            raise ValueError
        return int(data.decode().strip())
    except ValueError:
        raise ValueError(f"{url}: {shown(member.name, 80)} holds {shown(data, 80)}, not an integer class") from None


# ----- parquet writer -----
# Writing a Parquet file from any source (URLs, or ``(url, label)`` pairs), as ``write_shards``
# writes tar shards: the image bytes as they are and the label, ``rows_per_group`` rows a row
# group (the unit ``parquet()`` reads and shuffles by).
#
# Why these settings: images are compressed already, so their column is stored without
# compression or dictionary (compressing it again costs CPU on every read and saves nothing);
# a row group is what the loader reads at once, so the default 256 rows (~28 MB of
# ImageNet JPEGs) keeps a read near tar shards' 16 MB chunks; the class names are recorded where Hugging Face ``datasets`` records a ClassLabel's, so
# ``parquet()`` (and ``datasets``) find them.

def write_parquet(source: Sequence[Any], dest: str, *, rows_per_group: int = 256,
                  storage_options: dict | None = None, image: str = "image", label: str = "label") -> str:
    """Writes the items of ``source`` (e.g. ``image_folder`` or ``manifest``) to the Parquet file
    ``dest`` (local or bucket URL): column ``image`` the encoded bytes, column ``label`` the label
    when items are ``(url, label)`` pairs; ``rows_per_group`` rows a row group. Items are read
    concurrently through the loader's client; a row group is held in memory at a time. Returns
    ``dest``."""
    pq = pyarrow_parquet()
    import pyarrow as pa

    if rows_per_group < 1:
        raise ValueError(f"rows_per_group must be at least 1, got {rows_per_group}")
    labelled = len(source) > 0 and isinstance(source[0], (tuple, list))
    fields = [pa.field(image, pa.binary())] + ([pa.field(label, pa.int64())] if labelled else [])
    classes = list(getattr(source, "classes", []) or [])
    metadata = {}
    if labelled and classes:
        features = {image: {"_type": "Image"}, label: {"names": classes, "_type": "ClassLabel"}}
        metadata[b"huggingface"] = json.dumps({"info": {"features": features}}).encode()
    schema = pa.schema(fields, metadata=metadata or None)
    with Clients(storage_options or {}) as clients:
        out_fs, path = clients.for_url(dest)
        parent = path.rsplit("/", 1)[0] if "/" in path else ""
        if parent:
            out_fs.makedirs(parent, exist_ok=True)
        with out_fs.open(path, "wb") as file:
            writer = pq.ParquetWriter(file, schema, compression={image: "NONE", **({label: "SNAPPY"} if labelled else {})},
                                      use_dictionary=[label] if labelled else False, write_statistics=[label] if labelled else False)
            try:
                for start in range(0, len(source), rows_per_group):
                    items = [source[i] for i in range(start, min(start + rows_per_group, len(source)))]
                    urls = [item[0] if labelled else item for item in items]
                    columns = [pa.array(list(clients.read_all(urls)), pa.binary())]
                    if labelled:
                        columns.append(pa.array([int(item[1]) for item in items], pa.int64()))
                    writer.write_table(pa.Table.from_arrays(columns, schema=schema), row_group_size=rows_per_group)
            finally:
                writer.close()
    return dest
