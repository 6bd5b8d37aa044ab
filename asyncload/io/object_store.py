"""Which client serves a URL: obstore (Rust ``object_store``) for s3://, gs:// and az:// where it
is installed, fsspec's own filesystems (s3fs, gcsfs, adlfs, ...) for the rest.

Why: every GET through s3fs costs ~3.5 ms of Python CPU (botocore builds, signs and parses each
request in Python) on the loader's one event loop, which caps a process near 300 objects/s;
obstore does the same work in Rust for ~0.4 ms. Users keep writing the fsspec-style
``storage_options`` they know (``endpoint_url``, ``key``, ``secret``, ``anon``, ``profile``, GCS
``token``, ...): they are translated here, obstore's own names (``config``, ``client_options``,
``aws_endpoint``, ``region``, ...) are accepted as well, and an option obstore cannot serve
(``use_ssl``, ``s3_additional_kwargs``, gcsfs's ``token="cache"``, ...) sends that protocol back
to fsspec (the translation is in ``store_options``). ``storage_options={"client": "fsspec"}``
(or ``"obstore"``) chooses the client explicitly; ``"auto"`` is the default. For obstore's S3,
the region of a bucket nothing configures is asked of S3 once (``bucket_region``).
"""

from __future__ import annotations

import functools
import inspect
import os
import re
from datetime import timedelta
from typing import Any

import fsspec
import fsspec.asyn
from fsspec.core import split_protocol

from .limits import SampleTooLarge
from .store_options import Unsupported, obstore_settings


# ----- a bucket's region -----
# Which region an S3 bucket is in, for buckets whose region nothing configures: s3fs finds it by
# itself, obstore's client assumes us-east-1. One unsigned HEAD per bucket answers it; it blocks,
# so the reader asks on an I/O thread before a bucket's first read, never on the event loop.

# Where S3 says which region a bucket is in (the x-amz-bucket-region header of any answer,
# even a redirect or a denial), for buckets whose region nothing configures: s3fs finds it
# by itself, object_store assumes us-east-1.
AWS_BUCKET_REGION_URL = "https://s3.amazonaws.com/{bucket}"
REGION_KEYS = {"region", "aws_region", "default_region", "aws_default_region", "endpoint", "aws_endpoint",
               "aws_endpoint_url", "endpoint_url"}


def region_known(config: dict[str, Any], provider: Any) -> bool:
    """Whether a region (or an endpoint other than AWS's) is set in the options, the environment
    or the credential provider."""
    keys = {k.lower() for k in config} | {k.lower() for k in getattr(provider, "config", None) or {}}
    # four lookups, not a copy of the environment: this runs at every read of obstore's S3
    env = any(name in os.environ for name in ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT", "AWS_ENDPOINT_URL"))
    return bool(keys & REGION_KEYS) or env


_regions: dict[str, str | None] = {}  # bucket -> the region S3 named for it (None: it named none)


def region_found(bucket: str) -> str | None:
    """The region S3 named for ``bucket`` if it was asked already (``bucket_region``), else None:
    what an event loop may use, as it must not wait for the question."""
    return _regions.get(bucket)


def region_to_find(fs: Any, path: str) -> str | None:
    """The bucket of ``path`` whose region ``fs`` (obstore's S3) would ask S3 for when it first
    serves it, if not asked yet; else None."""
    if not hasattr(fs, "_credential_provider") or fs.protocol not in ("s3", "s3a"):
        return None  # not obstore's S3 (s3fs finds regions itself)
    bucket = path.split("://", 1)[-1].split("/", 1)[0]
    if bucket in _regions or region_known(fs._config or {}, fs._credential_provider):
        return None
    return bucket


def bucket_region(bucket: str, timeout: float = 5.0) -> str | None:
    """The region S3 names for ``bucket`` in one unsigned HEAD (None if it names none), asked
    once per bucket. Blocks up to ``timeout``: never call it on an event loop."""
    if bucket in _regions:
        return _regions[bucket]
    import urllib.error
    import urllib.request

    request = urllib.request.Request(AWS_BUCKET_REGION_URL.format(bucket=bucket), method="HEAD")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            region = response.headers.get("x-amz-bucket-region")
    except urllib.error.HTTPError as answer:  # 301, 403: still an answer with the header
        region = answer.headers.get("x-amz-bucket-region")
    except OSError:
        region = None
    _regions[bucket] = region  # one dict store: atomic; two threads asking at once both ask
    return region


# fsspec protocol -> obstore's scheme for it.
OBSTORE_SCHEMES = {"s3": "s3", "s3a": "s3", "gs": "gs", "gcs": "gs", "az": "az", "abfs": "az", "abfss": "az"}
CLIENTS = ("auto", "obstore", "fsspec")
SESSION_CLOSE_TIMEOUT_S = 10.0  # closing a session waits on no server; this bounds a stuck one
OWNED = "_asyncload_owned"  # set on the filesystems url_to_fs made for us alone
SESSIONS = ("_s3", "_session")  # where s3fs, and fsspec's http and gcsfs, keep an open client
# A listing's timeout per request and its retries (``sources/listing.py``) when neither its
# caller nor the storage options name them: AsyncLoader's read_timeout, and the count of retries
# reads had before they retried by time (``io/retries.py``): a listing runs before training.
LISTING_TIMEOUT_S = 60.0
LISTING_RETRIES = 6


def client_for(protocol: str, storage_options: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
    """``("obstore", FsspecStore keyword arguments)`` or ``("fsspec", that filesystem's options)``
    for ``protocol``. Raises ValueError naming an option neither client knows, or one that the
    explicitly chosen client cannot serve."""
    options = dict(storage_options or {})
    choice = options.pop("client", "auto")
    if choice not in CLIENTS:
        raise ValueError(f"storage_options['client'] must be one of {', '.join(map(repr, CLIENTS))}, got {choice!r}")
    scheme = OBSTORE_SCHEMES.get(protocol)
    if choice == "fsspec" or scheme is None or (choice == "auto" and not has_obstore()):
        return "fsspec", options  # local files, memory, http... stay fsspec's whatever the choice
    if not has_obstore():
        raise ValueError("storage_options['client'] is 'obstore', which is not installed (pip install obstore; Python >= 3.11)")
    try:
        return "obstore", obstore_settings(scheme, options)
    except Unsupported as error:
        if choice == "obstore":
            raise ValueError(f"storage_options: obstore cannot serve {error}; use client='fsspec'") from None
        return "fsspec", options


@functools.cache
def has_obstore() -> bool:
    try:
        import obstore.fsspec  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _store_class(protocol: str) -> type:
    """obstore's fsspec filesystem with ``protocol`` as its class's own (as ``obstore.fsspec.register``
    makes them, without touching fsspec's registry), so paths strip and unstrip as fsspec's do;
    for S3 it finds a bucket's region when nothing says it (``bucket_region``, above)."""
    from obstore.fsspec import FsspecStore
    from obstore.store import from_url

    def construct_store(self: Any, bucket: str) -> Any:
        config = self._config or {}
        if OBSTORE_SCHEMES[protocol] == "s3" and not region_known(config, self._credential_provider):
            # An asynchronous instance runs on the reader's event loop, which must not block: the
            # reader asked first, off the loop (a lookup that timed out leaves the default).
            region = region_found(bucket) if self.asynchronous else bucket_region(bucket)
            if region is not None:
                config = {**config, "region": region}
        return from_url(f"{OBSTORE_SCHEMES[protocol]}://{bucket}", config=config, client_options=self._client_options,
                        retry_config=self._retry_config, credential_provider=self._credential_provider,
                        **self._config_kwargs)

    return type(f"FsspecStore_{protocol}", (FsspecStore,), {"protocol": protocol, "_construct_store": construct_store})


def filesystem(protocol: str, storage_options: dict[str, Any] | None, *, loop: Any = None,
               read_timeout: float | None = None, connections: int = 64, listing: bool = False,
               timeout: float | None = None) -> Any:
    """A fresh filesystem for ``protocol`` from the client ``client_for`` picks; asynchronous
    (fsspec's) when ``loop`` is given. With ``read_timeout`` it is tuned for the reader, whose
    retries and timeout must be the only ones: the client retries nothing itself, its own
    timeout lies beyond ours, and it may hold ``connections`` connections. With ``listing`` it
    is tuned for a listing (see ``_obstore_for_listing``)."""
    client, options = client_for(protocol, storage_options)
    asynchronous = {"asynchronous": True} if loop is not None else {}
    if client == "obstore":  # obstore runs its own runtime: FsspecStore takes no loop
        if read_timeout is not None:
            _obstore_for_reads(options, read_timeout)
        elif listing:
            _obstore_for_listing(options, timeout)
        return _store_class(protocol)(skip_instance_cache=True, **options, **asynchronous)
    cls = fsspec.get_filesystem_class(protocol)
    if cls.async_impl and loop is not None:
        asynchronous["loop"] = loop
    is_s3fs = "config_kwargs" in inspect.signature(cls.__init__).parameters
    if is_s3fs and read_timeout is not None:
        _s3fs_for_reads(options, connections)
    elif is_s3fs and listing:
        _s3fs_for_listing(options, timeout)
    fs = cls(skip_instance_cache=True, **options, **asynchronous)
    if is_s3fs and (read_timeout is not None or listing) and "retries" not in options:
        fs.retries = 1  # s3fs's own retry loop: one attempt, then ours
    return fs


def _obstore_for_listing(options: dict[str, Any], timeout: float | None) -> None:
    """A listing retries whole requests itself, counted, with the reader's backoff: obstore
    retries nothing (the retries its options name are the listing's, see
    ``store_options.named_retries``), and each request ends after ``timeout`` seconds, or
    else the timeout the options name, or else ``LISTING_TIMEOUT_S`` (obstore's own 30 s
    with 10 retries made a listing against a server that never answers take 3 minutes)."""
    options["retry_config"] = {"max_retries": 0}
    client_options = dict(options.get("client_options") or {})
    if timeout is not None or "timeout" not in client_options:
        client_options["timeout"] = timedelta(seconds=timeout if timeout is not None else LISTING_TIMEOUT_S)
    options["client_options"] = client_options


def _s3fs_for_listing(options: dict[str, Any], timeout: float | None) -> None:
    """``_obstore_for_listing`` for s3fs: botocore retries nothing and ends each request as
    obstore's would."""
    config = dict(options.get("config_kwargs") or {})
    if timeout is not None or "read_timeout" not in config:
        config["read_timeout"] = timeout if timeout is not None else LISTING_TIMEOUT_S
    config.setdefault("connect_timeout", config["read_timeout"])
    config["retries"] = {"total_max_attempts": 1}
    options["config_kwargs"] = config


def _s3fs_for_reads(options: dict[str, Any], connections: int) -> None:
    """botocore allows 10 connections by default, which would cap reads in flight, and retries
    by itself, unseen and unbounded by ours."""
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("max_pool_connections", connections)
    config.setdefault("retries", {"total_max_attempts": 1})
    options["config_kwargs"] = config


def _obstore_for_reads(options: dict[str, Any], read_timeout: float) -> None:
    """obstore retries 10 times by itself and ends every request at 30 s: leave retrying to the
    reader and let its timeout be the one that fires (a user's own settings win). Its HTTP
    client has no cap on connections."""
    options["retry_config"] = options.get("retry_config") or {"max_retries": 0}
    options["client_options"] = {"timeout": timedelta(seconds=read_timeout + 1), **(options.get("client_options") or {})}


# The end of the one ranged GET that reads a whole object (see ``cat``): a server answers a range
# that runs past the end with the bytes there are (RFC 9110, 14.1.1).
WHOLE_OBJECT = 1 << 62
# What obstore says when a server did not answer a ranged GET with its range: 416 (an empty
# object has no byte to range over; some gateways refuse any range past the end) or a full 200
# body (object_store refuses it: GCS objects stored gzip-encoded, proxies that drop Range).
RANGE_REFUSED = re.compile(r"status code: 416|Range Not Satisfiable|non-partial response", re.IGNORECASE)


async def cat(fs: Any, path: str, start: int | None = None, end: int | None = None, limit: int | None = None) -> bytes:
    """The bytes of ``path`` ("bucket/key"; ``start``/``end``: of that range) from obstore
    filesystem ``fs``, in one request; a whole object no larger than ``limit`` bytes (else
    ``limits.SampleTooLarge``: it is read no further than ``limit + 1`` bytes).

    Why not ``fs._cat_file``: for a whole object it awaits obstore's ``get`` and then the body,
    two futures that each come back from obstore's Rust threads through the GIL, and parses the
    path as a URL on the way; one ranged GET to the end of the object is one future. On the
    2-core bench box that is 0.28-0.34 ms of CPU per 100 KB GET against 0.37-0.48 (the server
    on the same cores). The size budget costs no request: the range ends at ``limit + 1``. Where
    the server does not answer that range (see ``RANGE_REFUSED``) the object is read with a plain
    GET, its size checked before its body, and a server that ignored it is read plainly from then on."""
    bucket, _, key = path.partition("/")
    store = fs._construct_store(bucket)  # cached per bucket by FsspecStore
    if start is not None or end is not None:
        if start is None or end is None:
            raise NotImplementedError("a range needs both start and end")
        return (await store.get_range_async(key, start=start, end=end)).to_bytes()
    if not getattr(fs, "plain_gets", False):
        try:
            data = (await store.get_range_async(key, start=0, end=WHOLE_OBJECT if limit is None else limit + 1)).to_bytes()
        except Exception as error:
            if type(error).__module__ != "obstore.exceptions" or not RANGE_REFUSED.search(str(error)):
                raise
            if "non-partial" in str(error).lower():
                fs.plain_gets = True  # it ignores ranges: one GET, not two, for every later object
        else:
            if limit is not None and len(data) > limit:
                raise SampleTooLarge(fs.unstrip_protocol(path), await _size_or_none(store, key), limit)
            return data
    result = await store.get_async(key)
    size = result.meta.get("size") if isinstance(result.meta, dict) else None
    if limit is not None and size is not None and size > limit:
        raise SampleTooLarge(fs.unstrip_protocol(path), size, limit)
    return (await result.bytes_async()).to_bytes()


async def bounded_cat(fs: Any, limit: int, path: str, start: int | None = None, end: int | None = None) -> bytes:
    """``fs._cat_file`` (s3fs and other async fsspec filesystems) in one request, a whole object
    no further than ``limit + 1`` bytes (a ranged GET; an empty object, which has no byte to
    range over, with a plain one), ``SampleTooLarge`` past ``limit`` (its size then asked)."""
    if start is not None or end is not None:
        return await fs._cat_file(path, start=start, end=end, max_concurrency=1)
    try:
        data = await fs._cat_file(path, start=0, end=limit + 1, max_concurrency=1)
    except OSError as error:
        if "not satisfiable" not in str(error).lower():
            raise
        return await fs._cat_file(path, max_concurrency=1)
    if len(data) > limit:
        try:
            size = int((await fs._info(path))["size"])
        except Exception:
            size = None
        raise SampleTooLarge(fs.unstrip_protocol(path), size, limit)
    return data


async def _size_or_none(store: Any, key: str) -> int | None:
    """The object's size, for the message of one that was too large (a HEAD, on that path alone)."""
    try:
        return int((await store.head_async(key))["size"])
    except Exception:
        return None


def url_to_fs(url: str, storage_options: dict[str, Any] | None, *, listing: bool = False,
              timeout: float | None = None) -> tuple[Any, str]:
    """``fsspec.core.url_to_fs`` through ``filesystem``: the filesystem and the path in it. An
    unchained URL's instance is our own, never fsspec's cached one (which a user may hold too),
    and marked so: ``release`` closes only those. (A chained URL's inner filesystems come from
    fsspec's cache, and ``simplecache::`` hands attribute lookups on to them.) With ``listing``
    an obstore or s3fs client retries nothing and ends each request after ``timeout`` (see
    ``_obstore_for_listing``); other filesystems keep their own settings."""
    protocol = split_protocol(url)[0] or "file"
    if protocol not in OBSTORE_SCHEMES:
        options = {k: v for k, v in (storage_options or {}).items() if k != "client"}
        if "::" in url:
            return fsspec.core.url_to_fs(url, **options)
        fs, path = fsspec.core.url_to_fs(url, **{**options, "skip_instance_cache": True})
    else:
        fs = filesystem(protocol, storage_options, listing=listing, timeout=timeout)  # a fresh instance too
        path = fs._strip_protocol(url)
    vars(fs)[OWNED] = True
    return fs, path


def release(fs: Any) -> None:
    """Closes the connections a filesystem made by ``url_to_fs`` keeps, once a listing or a
    write is done with it. obstore holds a store, with its pool, per bucket in an lru_cache on
    the instance (a reference cycle, so dropping the instance would free them only at a GC);
    s3fs and fsspec's http keep an aiohttp session on fsspec's IO thread until theirs is
    collected, and SeaweedFS or a bucket keeps those connections alive meanwhile."""
    if is_obstore(fs):
        fs._construct_store.cache_clear()
    elif vars(fs).get(OWNED) and not getattr(fs, "asynchronous", False) and any(vars(fs).get(name) for name in SESSIONS):
        try:  # the listing or write is done: a failure to close must not fail it
            fsspec.asyn.sync(fs.loop, close_sessions, fs, timeout=SESSION_CLOSE_TIMEOUT_S)
        except Exception:
            pass


async def close_sessions(fs: Any) -> None:
    """Closes filesystem ``fs``'s connections on the loop its client runs on (obstore's pools
    go with ``release``, on any thread). ``session = await fs.set_session(); await
    session.close()`` is how s3fs and fsspec's http say to (gcsfs names it ``_set_session``).
    Errors while closing are of no use to anyone and are ignored."""
    try:
        if is_obstore(fs):
            release(fs)
            return
        set_session = getattr(fs, "set_session", None) or getattr(fs, "_set_session", None)
        if set_session is not None:
            session = await set_session()
            close = getattr(session, "close", None)
            if close is not None and inspect.iscoroutinefunction(close):
                await close()
    except Exception:
        pass


def is_obstore(fs: Any) -> bool:
    return has_obstore() and isinstance(fs, __import__("obstore.fsspec").fsspec.FsspecStore)
