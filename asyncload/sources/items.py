"""Sources: the items of a dataset, listed once up front and kept compactly.

A million URLs as Python strings cost ~100 MB of objects; here they are one UTF-8 blob plus an
offset array, and labels one int64 array. The requests to storage go through ``listing``
(timeout, retries, short errors); what is found, or not, is judged here.
"""

from __future__ import annotations

import hashlib
import posixpath
from typing import Any, Callable, Iterable, Sequence, TypeVar

import numpy as np

from ..io.reader import version_of
from ..redact import shown
from . import listing

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff")


def is_labelled(item: Any) -> bool:
    """A ``(key, int label)`` pair."""
    return (
        isinstance(item, (tuple, list))
        and len(item) == 2
        and isinstance(item[1], (int, np.integer))
        and not isinstance(item[1], bool)
    )


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
    """A sized sequence of URLs, or of ``(url, label)`` pairs when labels are given: what
    ``image_folder``, ``list_files`` and ``manifest`` return and ``AsyncLoader`` takes.

    The URLs are kept as one UTF-8 blob and the labels as one int64 array, so a million items
    cost a few tens of MB rather than a Python string each. Index it as a list (``source[i]``,
    negative ``i`` from the end); ``len(source)`` is the number of items.

    Args:
        urls (iterable of str): the items' URLs (local paths or any fsspec URL), in the order
            the source keeps them.
        labels (iterable of int, optional): one integer label per URL; then each item is
            ``(url, label)``. Default: ``None`` (items are bare URLs).
        classes (sequence of str, optional): the class names, ``classes[label]`` naming a
            label (``image_folder`` fills it). Default: ``()``.
        cache_dir (str, optional): a local folder where objects read from a bucket are kept
            whole, so later epochs read them from disk (``docs/guides/caching.md``).
            Default: ``None`` (no cache).
        cache_bytes (int, optional): the most the cache keeps, least recently used first out.
            Default: ``None``, the smaller of 64 GiB and half the disk's free space.
        listing (sequence of dict, optional): each URL's ``info()`` from the listing (size and
            ETag: a kept copy is checked against them with no request). Default: ``None``
            (each object is asked about once per process).

    Raises:
        ValueError: if ``labels`` is given and does not hold one label per URL.
    """

    def __init__(self, urls: Iterable[str], labels: Iterable[int] | None = None, classes: Sequence[str] = (), *,
                 cache_dir: str | None = None, cache_bytes: int | None = None,
                 listing: Sequence[dict] | None = None) -> None:
        encoded = [url.encode() for url in urls]
        self._offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(e) for e in encoded], out=self._offsets[1:])
        self._blob = b"".join(encoded)
        self.labels = None if labels is None else np.asarray(list(labels), dtype=np.int64)
        if self.labels is not None and len(self.labels) != len(encoded):
            raise ValueError(f"{len(encoded)} URLs but {len(self.labels)} labels")
        self.classes = list(classes)
        self.cache_dir = None if cache_dir is None else str(cache_dir)
        self.cache_bytes = cache_bytes
        self.has_listing = listing is not None
        if listing is not None and len(listing) != len(encoded):
            raise ValueError(f"{len(encoded)} URLs but {len(listing)} listing entries")
        # what the item cache checks a kept copy against: sizes, and a 64-bit hash of each version
        self._sizes = np.array([int(info.get("size") or 0) for info in listing or ()], dtype=np.int64)
        self._versions = np.array([_hash64(version_of(info)) for info in listing or ()], dtype=np.uint64)

    def listed(self, index: int) -> tuple[int, str]:
        """Item ``index``'s size and version as listed (with ``listing``; see ``cache/items.py``)."""
        return int(self._sizes[index]), f"listed {int(self._versions[index]):016x}"

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def url(self, index: int) -> str:
        """The URL of item ``index`` (without its label)."""
        return self._blob[self._offsets[index] : self._offsets[index + 1]].decode()

    def __getitem__(self, index: int) -> Any:  # type: ignore[override]
        index = checked_index(index, len(self), "Source")
        if self.labels is None:
            return self.url(index)
        return self.url(index), int(self.labels[index])

    def __repr__(self) -> str:
        return f"Source({len(self)} items, {len(self.classes)} classes)"


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


Documented = TypeVar("Documented", bound=Callable[..., Any])
# What the sources' docstrings share (image_folder, list_files, manifest, mds, litdata): ``with_shared_docs``
# puts it in place of "{storage_options}", "{timeout and retries}", "{cache}" and "{storage errors}".
_STORAGE_OPTIONS = """storage_options (dict, optional): options for the storage client, as fsspec takes them
            (for S3, s3fs's: ``endpoint_url``, ``key``, ``secret``, ``anon``, ``profile``,
            ``config_kwargs``, ...; gcsfs's and adlfs's for GCS and Azure), passed the same way
            to ``AsyncLoader``. Default: ``None`` (the client finds credentials itself, as
            boto3 or gcloud would). Set it for a non-AWS endpoint, explicit credentials or
            public buckets (``{"anon": True}``)."""
_TIMEOUT_AND_RETRIES = """timeout (float, optional): seconds each request to object storage (S3, GCS, Azure)
            may take before it counts as failed and is tried again (other fsspec filesystems
            keep their own timeouts). Default: ``None``, which takes the timeout
            ``storage_options`` name (s3fs's ``config_kwargs={"read_timeout": ...}``,
            obstore's ``client_options["timeout"]``) and else 60 s, as ``AsyncLoader``'s
            ``read_timeout``. Lower it to fail fast against an endpoint that does not answer.
        retries (int, optional): how many times a failed request is tried again, after a
            jittered pause that doubles from about 0.1 s up to 2 s. Default: ``None``, which
            takes the retries ``storage_options`` name (s3fs's
            ``config_kwargs={"retries": {"max_attempts": ...}}``, obstore's
            ``retry_config["max_retries"]``) and else 6, as ``AsyncLoader``'s
            ``read_retries``. Set 0 to fail at the first error."""
_CACHE = """cache_dir (str, optional): a local folder where the objects read from a bucket are kept
            whole after their first read, so later epochs (and runs) read them from local disk and
            send no request: least recently used out first, shared safely by the processes of a
            node (see ``docs/guides/caching.md``). Local files are never cached. Default:
            ``None`` (every epoch reads the bucket).
        cache_bytes (int, optional): the most ``cache_dir`` keeps. Default: ``None``, the
            smaller of 64 GiB and half the disk's free space at the start of a run."""
_STORAGE_ERROR = """StorageError: (an ``OSError``) if storage still fails after ``retries`` retries (an
            endpoint that does not answer, throttling, a server error) or at once where
            another try cannot help (access denied). It names the URL and the attempts made;
            the client's own exception is its ``__cause__``."""


def with_shared_docs(function: Documented) -> Documented:
    """``function`` with the shared parts of its docstring in place, so ``help()`` shows them."""
    for marker, text in (("{storage_options}", _STORAGE_OPTIONS), ("{timeout and retries}", _TIMEOUT_AND_RETRIES),
                         ("{cache}", _CACHE), ("{storage errors}", _STORAGE_ERROR)):
        function.__doc__ = (function.__doc__ or "").replace(marker, text)
    return function


def _extensions(extensions: Sequence[str]) -> str:
    return ", ".join(extensions)


@with_shared_docs
def image_folder(url: str, storage_options: dict | None = None, extensions: Sequence[str] = IMAGE_EXTENSIONS, *,
                 timeout: float | None = None, retries: int | None = None, cache_dir: str | None = None,
                 cache_bytes: int | None = None) -> Source:
    """The images under ``url/<class>/.../<file>`` as ``(url, label)`` items, as torchvision's
    ``ImageFolder`` finds them: the label is the index of the class folder in sorted order,
    ``source.classes`` holds the class names, and the items are sorted by path.

    The folder is listed once, when this is called; files at its top level (in no class
    folder) and files with other extensions are left out.

    Args:
        url (str): the folder that holds one folder per class: a local path or any fsspec URL,
            e.g. a bucket prefix ``"s3://bucket/imagenet/train"``.
        {storage_options}
        extensions (sequence of str): the file name endings that count as images, compared
            case-insensitively. Default: ``.jpg .jpeg .png .webp .bmp .tif .tiff``. Narrow
            it to leave other files (e.g. masks) out, widen it for other formats your
            ``decode`` reads.
        {timeout and retries}
        {cache}

    Raises:
        FileNotFoundError: if ``url`` is no folder: a missing local folder, a bucket prefix
            that holds no object, or a bucket that does not exist.
        ValueError: if the folder holds no file with one of ``extensions`` inside a class
            folder (it is empty, holds other files, or its images lie at its top level).
        {storage errors}
    """
    looked_for = f"class folders holding files ending in {_extensions(extensions)}"
    infos: dict[str, dict] | None = None if cache_dir is None else {}
    fs, root, paths = _find(url, storage_options, extensions, timeout, retries, looked_for, infos)
    relative = [posixpath.relpath(p, root) for p in paths]
    in_class = [(p, r.split("/", 1)[0]) for p, r in zip(paths, relative) if "/" in r]
    if not in_class:
        found = f"only {len(paths)} at its top level, in no class folder" if paths else "none"
        raise ValueError(f"{url}: looked for {looked_for} (<class>/<file>), found {found}")
    classes = sorted({cls for _, cls in in_class})
    index = {cls: i for i, cls in enumerate(classes)}
    return Source((listing.url_of(fs, p) for p, _ in in_class), (index[c] for _, c in in_class), classes, cache_dir=cache_dir,
                  cache_bytes=cache_bytes, listing=None if infos is None else [infos[p] for p, _ in in_class])


@with_shared_docs
def list_files(url: str, storage_options: dict | None = None, extensions: Sequence[str] = IMAGE_EXTENSIONS, *,
               timeout: float | None = None, retries: int | None = None, cache_dir: str | None = None,
               cache_bytes: int | None = None) -> Source:
    """Every file under ``url`` (at any depth) with one of ``extensions``, sorted by path, as
    bare URLs without labels. The folder is listed once, when this is called.

    Args:
        url (str): a local folder or any fsspec URL, e.g. a bucket prefix ``"s3://bucket/images"``.
        {storage_options}
        extensions (sequence of str): the file name endings to keep, compared
            case-insensitively. Default: ``.jpg .jpeg .png .webp .bmp .tif .tiff``. Change it
            for other file types (e.g. ``(".npy",)`` with a ``decode`` that reads them).
        {timeout and retries}
        {cache}

    Raises:
        FileNotFoundError: if ``url`` is no folder: a missing local folder, a bucket prefix
            that holds no object, or a bucket that does not exist.
        ValueError: if the folder holds no file with one of ``extensions``.
        {storage errors}
    """
    looked_for = f"files ending in {_extensions(extensions)}"
    infos: dict[str, dict] | None = None if cache_dir is None else {}
    fs, _, paths = _find(url, storage_options, extensions, timeout, retries, looked_for, infos)
    if not paths:
        raise ValueError(f"{url}: looked for {looked_for}, found none")
    return Source((listing.url_of(fs, p) for p in paths), cache_dir=cache_dir, cache_bytes=cache_bytes,
                  listing=None if infos is None else [infos[p] for p in paths])


@with_shared_docs
def manifest(url: str, storage_options: dict | None = None, *, timeout: float | None = None,
             retries: int | None = None, cache_dir: str | None = None, cache_bytes: int | None = None) -> Source:
    """The items a text file lists, one a line: ``url``, or ``url<TAB>label`` (or
    ``url,label``) with an integer label. Either every line has a label or none does; blank
    lines are skipped. The file is read once, when this is called; the URLs in it are not
    checked until the loader reads them.

    Args:
        url (str): the manifest file: a local path or any fsspec URL, e.g.
            ``"s3://bucket/train.tsv"``.
        {storage_options}
        {timeout and retries}
        {cache}

    Raises:
        FileNotFoundError: if there is no file at ``url`` (or its bucket does not exist).
        ValueError: if the file lists no item (it is empty or blank), or some lines have a
            label and others none or one that is not an integer (the line is named).
        {storage errors}
    """
    data = listing.read_bytes(url, storage_options, timeout=timeout, retries=retries, what="manifest")
    rows = _manifest_lines(data, url)
    if not rows:
        raise ValueError(f"manifest {url} lists no item (expected one 'url' or 'url<TAB>label' a line)")
    split = [row.split("\t") if "\t" in row else row.rsplit(",", 1) if "," in row else [row] for _, row in rows]
    cache = {"cache_dir": cache_dir, "cache_bytes": cache_bytes}
    if all(len(parts) == 1 for parts in split):
        return Source((parts[0] for parts in split), **cache)
    bad = [(number, row) for (number, row), parts in zip(rows, split)
           if len(parts) != 2 or not parts[1].strip().lstrip("-").isdigit()]
    if bad:
        number, row = bad[0]
        raise ValueError(f"{url}: expected 'url<TAB>label' with an integer label on every line, "
                         f"got {shown(row, 80)} on line {number}")
    return Source((parts[0] for parts in split), (int(parts[1]) for parts in split), **cache)


def _manifest_lines(data: bytes, url: str) -> list[tuple[int, str]]:
    """The non-blank lines of a manifest as ``(line number, text)``, stripped: UTF-8, a leading
    byte order mark dropped, lines ended by ``\\n`` (or ``\\r\\n``) alone. ``str.splitlines`` would
    also split inside a URL at U+2028, U+0085 or a form feed, which are valid in object names.
    A NUL, which no path or URL holds, means a file that is no manifest: ValueError naming the line."""
    text = data.decode("utf-8-sig")
    lines = text.split("\n")
    if "\0" in text:
        number = next(n for n, line in enumerate(lines, 1) if "\0" in line)
        raise ValueError(f"manifest {url}: line {number} holds a NUL byte (a binary file, or not UTF-8 text?)")
    return [(number, line.strip(" \t\r")) for number, line in enumerate(lines, 1) if line.strip(" \t\r")]


def _find(url: str, storage_options: dict | None, extensions: Sequence[str], timeout: float | None,
          retries: int | None, looked_for: str, infos: dict[str, dict] | None = None) -> tuple[Any, str, list[str]]:
    """The filesystem, the root path and the sorted paths (without protocol) of every file
    under ``url`` with one of ``extensions`` (see ``listing.find``; ``infos`` gets their info)."""
    fs, root, paths = listing.find(url, storage_options, timeout=timeout, retries=retries, looked_for=looked_for,
                                   infos=infos)
    wanted = tuple(e.lower() for e in extensions)
    return fs, root, [p for p in paths if p.lower().endswith(wanted)]

