"""Sources: the items of a dataset, listed once up front and kept compactly.

A million URLs as Python strings cost ~100 MB of objects; here they are one UTF-8 blob plus an
offset array, and labels one int64 array.
"""

from __future__ import annotations

import posixpath
from typing import Any, Iterable, Sequence

import numpy as np

from ..io import object_store

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff")


def checked_index(index: Any, length: int, kind: str) -> int:
    """``index`` as a position in ``range(length)``, counting a negative one from the end, as a
    list does; a slice or a position outside raises. ``kind`` names the sequence in the error."""
    if isinstance(index, slice):
        raise TypeError(f"a {kind} is indexed by integers")
    if index < 0:
        index += length
    if not 0 <= index < length:
        raise IndexError(index)
    return index


class Source(Sequence):
    """A sized sequence of URLs, or of ``(url, label)`` pairs when labels are given."""

    def __init__(self, urls: Iterable[str], labels: Iterable[int] | None = None, classes: Sequence[str] = ()) -> None:
        encoded = [url.encode() for url in urls]
        self._offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(e) for e in encoded], out=self._offsets[1:])
        self._blob = b"".join(encoded)
        self.labels = None if labels is None else np.asarray(list(labels), dtype=np.int64)
        if self.labels is not None and len(self.labels) != len(encoded):
            raise ValueError(f"{len(encoded)} URLs but {len(self.labels)} labels")
        self.classes = list(classes)

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def url(self, index: int) -> str:
        return self._blob[self._offsets[index] : self._offsets[index + 1]].decode()

    def __getitem__(self, index: int) -> Any:  # type: ignore[override]
        index = checked_index(index, len(self), "Source")
        if self.labels is None:
            return self.url(index)
        return self.url(index), int(self.labels[index])

    def __repr__(self) -> str:
        return f"Source({len(self)} items, {len(self.classes)} classes)"


def _find(url: str, storage_options: dict | None, extensions: Sequence[str]) -> tuple[Any, str, list[str]]:
    """Lists every file under ``url`` with one of ``extensions``: the filesystem, the root path
    and the sorted file paths (without protocol)."""
    fs, root = object_store.url_to_fs(url, storage_options)
    wanted = tuple(e.lower() for e in extensions)
    try:
        paths = sorted(p for p in fs.find(root) if p.lower().endswith(wanted))
    finally:
        object_store.release(fs)
    return fs, root.rstrip("/"), paths


def _to_url(fs: Any, path: str) -> str:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return path if protocol in ("file", "local") else fs.unstrip_protocol(path)


def image_folder(url: str, storage_options: dict | None = None, extensions: Sequence[str] = IMAGE_EXTENSIONS) -> Source:
    """``url/<class>/.../<file>`` (local or any fsspec URL, e.g. a bucket prefix) -> ``(url, label)``
    items, label = index of the class folder in sorted order, as torchvision's ImageFolder."""
    fs, root, paths = _find(url, storage_options, extensions)
    relative = [posixpath.relpath(p, root) for p in paths]
    in_class = [(p, r.split("/", 1)[0]) for p, r in zip(paths, relative) if "/" in r]
    classes = sorted({cls for _, cls in in_class})
    index = {cls: i for i, cls in enumerate(classes)}
    return Source((_to_url(fs, p) for p, _ in in_class), (index[c] for _, c in in_class), classes)


def list_files(url: str, storage_options: dict | None = None, extensions: Sequence[str] = IMAGE_EXTENSIONS) -> Source:
    """Every file under ``url`` with one of ``extensions``, sorted, without labels."""
    fs, _, paths = _find(url, storage_options, extensions)
    return Source(_to_url(fs, p) for p in paths)


def manifest(url: str, storage_options: dict | None = None) -> Source:
    """A text file of one item per line: ``url`` or ``url<TAB>label`` (or ``url,label``).
    Either every line has a label or none does."""
    fs, path = object_store.url_to_fs(url, storage_options)
    try:
        rows = [line.strip() for line in fs.cat_file(path).decode().splitlines() if line.strip()]
    finally:
        object_store.release(fs)
    split = [row.split("\t") if "\t" in row else row.rsplit(",", 1) if "," in row else [row] for row in rows]
    if all(len(parts) == 1 for parts in split):
        return Source(parts[0] for parts in split)
    bad = [row for row, parts in zip(rows, split) if len(parts) != 2 or not parts[1].strip().lstrip("-").isdigit()]
    if bad:
        raise ValueError(f"{url}: expected 'url<TAB>label' with an integer label on every line, got {bad[0]!r}")
    return Source((parts[0] for parts in split), (int(parts[1]) for parts in split))
