"""Listing a folder or bucket prefix, and reading a small file such as a manifest, with the
reader's timeout and retries, for the sources built before a loader runs.

Why one place: every request a source makes up front goes through ``with_retries``, which counts
attempts, waits the reader's backoff between them and turns what failed into one short error:
``FileNotFoundError`` where the folder, prefix, bucket or file is not there (another try
cannot help), ``StorageError`` naming the URL and the attempts for anything else, with the
client's exception as ``__cause__``. Left to themselves the clients would retry on their own
terms (obstore: 30 s a request, 10 retries, a 3-minute wait against a server that never
answers, ending in a 1,000-character Rust dump).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, TypeVar

from ..errors import StorageError
from ..io import object_store
from ..io.retries import RetryBudget
from ..io.store_options import named_retries

T = TypeVar("T")
LOCAL_PROTOCOLS = ("file", "local")


def retries_for(retries: int | None, storage_options: dict | None) -> int:
    """``retries`` when given, else those ``storage_options`` name, else AsyncLoader's default."""
    if retries is None:
        retries = named_retries(storage_options)
    return object_store.LISTING_RETRIES if retries is None else int(retries)


@contextlib.contextmanager
def opened(url: str, storage_options: dict | None, timeout: float | None) -> Iterator[tuple[Any, str]]:
    """The filesystem for ``url`` tuned for listing (each request ends after ``timeout``, see
    ``object_store._obstore_for_listing``) and the path in it; its connections are closed after."""
    fs, path = object_store.url_to_fs(url, storage_options, listing=True, timeout=timeout)
    try:
        yield fs, path
    finally:
        object_store.release(fs)


def find(url: str, storage_options: dict | None, *, timeout: float | None, retries: int | None,
         looked_for: str, infos: dict[str, dict] | None = None) -> tuple[Any, str, list[str]]:
    """Every file under ``url``, sorted: the filesystem (closed; it still strips and unstrips
    paths), the root path and the file paths without protocol. Raises FileNotFoundError where
    ``url`` is no folder (no object under the prefix, no such bucket), saying it looked for
    ``looked_for``; a folder that holds no file is the caller's to judge. ``infos``, if given,
    gets each path's ``info()`` as the listing returned it (size, ETag: the item cache's check)."""
    retries = retries_for(retries, storage_options)
    with opened(url, storage_options, timeout) as (fs, root):
        where = "folder" if is_local(fs) else "bucket, or no object under that prefix"
        missing = f"{url}: no such {where} (looked for {looked_for})"
        found = with_retries(url, "listing", retries, missing, lambda: fs.find(root, detail=infos is not None))
        paths = sorted(found)
        if infos is not None:
            infos.update(found)
        if not paths and not with_retries(url, "listing", retries, missing, lambda: fs.isdir(root)):
            raise FileNotFoundError(missing)
    return fs, root.rstrip("/"), paths


def read_bytes(url: str, storage_options: dict | None, *, timeout: float | None, retries: int | None,
               what: str) -> bytes:
    """The bytes of the file at ``url`` (``what`` names it in a FileNotFoundError)."""
    retries = retries_for(retries, storage_options)
    with opened(url, storage_options, timeout) as (fs, path):
        return with_retries(url, "reading", retries, f"{what} {url} not found", lambda: fs.cat_file(path))


def is_local(fs: Any) -> bool:
    """Whether ``fs`` is fsspec's local filesystem (its paths are the URLs)."""
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in LOCAL_PROTOCOLS


def url_of(fs: Any, path: str) -> str:
    """The URL of ``path`` as ``fs`` listed it: the path itself on a local disk, else with its
    protocol (``s3://bucket/key``), so every source names its items the way a user writes them."""
    return path if is_local(fs) else fs.unstrip_protocol(path)


def with_retries(url: str, action: str, retries: int, missing: str, request: Callable[[], T]) -> T:
    """``request()``, tried up to ``1 + retries`` times in the reads' retry loop (tenacity's,
    under a budget by count, with the reads' backoff: ``retries.RetryBudget``). Raises
    FileNotFoundError(``missing``) where storage says the thing is not there, and
    StorageError(url, action, attempts, error) at once for an error another try cannot fix
    (denied, invalid), or once the retries are spent."""

    def attempt() -> T:
        try:
            return request()
        except Exception as error:
            if _is_missing(error):  # a permanent error: not tried again
                raise FileNotFoundError(missing) from error
            raise

    loop = RetryBudget(retries=retries).retrying(asynchronous=False)
    try:
        return loop(attempt)
    except FileNotFoundError:  # every one is ``missing`` (see attempt)
        raise
    except Exception as error:
        raise StorageError(url, action, loop.statistics.get("attempt_number", 1), error) from error


def _is_missing(error: Exception) -> bool:
    """FileNotFoundError, obstore's NotFoundError, or a bucket that does not exist (obstore
    reports S3's NoSuchBucket for a listing as a GenericError)."""
    name, module = type(error).__name__, type(error).__module__
    return isinstance(error, FileNotFoundError) or (module == "obstore.exceptions" and (
        name == "NotFoundError" or "NoSuchBucket" in str(error)))

