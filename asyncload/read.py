"""Reads on one asyncio event loop: fsspec filesystems, retries with backoff, a timeout per read.

Async filesystems (s3fs, gcsfs, http, obstore's FsspecStore) are awaited natively, so hundreds of
requests can wait on the network at once from one thread; sync ones (local disk, memory) run on a
small executor.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import random
import sys
import time
from datetime import timedelta
from typing import Any, Awaitable, Callable

import fsspec
from fsspec.core import split_protocol

from .blocking import BlockingCalls
from .stats import LoaderStats

LOCAL_PROTOCOLS = ("file", "local", "memory")
SHUTDOWN_WAIT_S = 10.0  # how long closing waits for reads still running (stuck ones are left)

# Errors that another try cannot fix. Anything else (timeouts, resets, throttling, 5xx) is retried.
PERMANENT_ERRORS = (
    FileNotFoundError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    ValueError,
    TypeError,
    NotImplementedError,
)
# obstore raises FileNotFoundError itself, and these of its own (all derive from Exception only).
OBSTORE_PERMANENT_ERRORS = {
    "NotFoundError": FileNotFoundError,
    "PermissionDeniedError": PermissionError,
    "UnauthenticatedError": PermissionError,
    "InvalidPathError": ValueError,
    "UnknownConfigurationKeyError": ValueError,
    "NotSupportedError": NotImplementedError,
}


def backoff(attempt: int) -> float:
    """Seconds to wait before retry ``attempt`` (0-based): half of an exponential step for sure,
    the other half drawn at random ("equal jitter"). The random half spreads many readers'
    retries apart; the sure half gives the default 6 retries at least 3.1 s in all (full jitter
    could spend under 1 s now and then, failing reads across a server restart of a second)."""
    step = min(5.0, 0.1 * 2**attempt)
    return step / 2 + random.uniform(0, step / 2)


class Reader:
    """Fetches items on the event loop ``loop``; create and use it on that loop's thread."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        storage_options: dict[str, Any] | None,
        timeout: float,
        retries: int,
        io_concurrency: int,
        stats: LoaderStats,
        user_read: Callable[[Any], Any] | None = None,
    ) -> None:
        self.loop = loop
        self.storage_options = storage_options or {}
        self.timeout = timeout
        self.retries = retries
        self.stats = stats
        self.user_read = user_read
        self.io_concurrency = io_concurrency
        self._user_read_is_async = user_read is not None and _is_async_callable(user_read)
        # Sync reads (user functions, sync remote filesystems, local files) wait here; 32 threads
        # are plenty to wait on and few enough not to crowd the decode threads out of the GIL.
        # Each read's timeout counts from its start on a thread, and stuck reads cannot fill it.
        self._blocking = BlockingCalls(min(io_concurrency, 32), "asyncload-read")
        self._filesystems: dict[str, Any] = {}

    async def read(self, key: Any) -> Any:
        """The bytes at URL ``key`` (or what the user's ``read`` returns for it), retried on
        transient errors with exponential backoff and jitter (see ``backoff``)."""
        return await self._counted(lambda: self._fetch(key))

    async def read_range(self, url: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``url`` in one ranged request, retried as ``read`` is."""
        return await self._counted(lambda: self._fetch_file(url, start=start, end=end))

    async def _counted(self, fetch: Callable[[], Awaitable[Any]]) -> Any:
        started = time.perf_counter()
        self.stats.level("reads_in_flight", 1)
        try:
            data = await self._with_retries(fetch)
        finally:
            self.stats.level("reads_in_flight", -1)
        nbytes = len(data) if isinstance(data, (bytes, bytearray, memoryview)) else 0
        self.stats.add("read", time.perf_counter() - started, nbytes)
        return data

    async def _with_retries(self, fetch: Callable[[], Awaitable[Any]]) -> Any:
        for attempt in range(self.retries + 1):
            try:
                return await fetch()  # _fetch and _fetch_file apply self.timeout
            except PERMANENT_ERRORS:
                raise
            except Exception as error:
                permanent = _as_builtin(error)
                if permanent is not None:
                    raise permanent from error
                if attempt == self.retries:
                    raise
                self.stats.add_retry()
                await asyncio.sleep(backoff(attempt))
        raise AssertionError("unreachable")

    def is_local(self, key: Any) -> bool:
        """True for URLs on local disk or in memory. These are read by the decode thread itself
        (``read_local``): a page-cache read costs tens of microseconds, less than handing the
        sample from an I/O thread through the event loop to a decode thread."""
        if self.user_read is not None or not isinstance(key, str):
            return False
        fs, _ = self._filesystem(key)
        return not fs.async_impl and _protocol(fs) in LOCAL_PROTOCOLS

    def read_local(self, key: str) -> bytes:
        """Reads a local URL for the calling (decode) thread (see ``is_local``), on a read
        thread so that a read that hangs (a stuck network mount, a FIFO) fails after the read
        timeout, as remote reads do, instead of holding the decode thread and its row for ever.
        Not retried: a local file that did not answer within the timeout will not soon."""
        started = time.perf_counter()
        fs, _ = self._filesystems[split_protocol(key)[0] or "file"]
        self.stats.level("reads_in_flight", 1)
        try:
            data = self._blocking.call(fs.cat_file, fs._strip_protocol(key), timeout=self.timeout)
        finally:
            self.stats.level("reads_in_flight", -1)
        self.stats.add("read", time.perf_counter() - started, len(data))
        return data

    def _fetch(self, key: Any) -> Awaitable[Any]:
        if self.user_read is not None:
            if self._user_read_is_async:
                return asyncio.wait_for(self.user_read(key), self.timeout)
            return self._blocking.call_async(self.user_read, key, timeout=self.timeout)
        return self._fetch_file(key)

    def _fetch_file(self, url: str, **byte_range: int) -> Awaitable[bytes]:
        """The bytes of ``url`` (``start``/``end``: of that range) through its filesystem."""
        fs, read_kwargs = self._filesystem(url)
        path = fs._strip_protocol(url)
        if fs.async_impl:
            return asyncio.wait_for(fs._cat_file(path, **read_kwargs, **byte_range), self.timeout)
        return self._blocking.call_async(functools.partial(fs.cat_file, path, **byte_range), timeout=self.timeout)

    async def version(self, url: str) -> str:
        """What identifies the current content of ``url``: its ETag, else its modification
        time, with its size (one metadata request, retried as reads are; not counted as one)."""
        fs, _ = self._filesystem(url)
        path = fs._strip_protocol(url)
        if fs.async_impl:
            info = await self._with_retries(lambda: asyncio.wait_for(fs._info(path), self.timeout))
        else:
            info = await self._with_retries(lambda: self._blocking.call_async(fs.info, path, timeout=self.timeout))
        return _version_of(info)

    async def run_blocking(self, function: Callable[..., Any], *args: Any) -> Any:
        """Runs ``function(*args)`` on the I/O threads (file work that must not block the loop),
        with no timeout: cache work on local disk, which must not be abandoned half done."""
        return await asyncio.wrap_future(self._blocking.submit(function, *args).future)

    def _filesystem(self, url: str) -> tuple[Any, dict[str, Any]]:
        """The filesystem for ``url``'s protocol (one instance per protocol, bound to our loop)
        and the keyword arguments that make its read a single request."""
        protocol = split_protocol(url)[0] or "file"
        if protocol not in self._filesystems:
            cls = fsspec.get_filesystem_class(protocol)
            options = dict(self.storage_options)
            if cls.async_impl:
                options.update(asynchronous=True, loop=self.loop)
            is_s3fs = "config_kwargs" in inspect.signature(cls.__init__).parameters
            if is_s3fs:
                self._s3fs_options(options)
            elif _is_obstore(cls):
                self._obstore_options(options)
            fs = cls(skip_instance_cache=True, **options)
            if is_s3fs and "retries" not in self.storage_options:
                fs.retries = 1  # s3fs's own retry loop: one attempt, then ours
            read_kwargs = {}
            if fs.async_impl and "max_concurrency" in inspect.signature(fs._cat_file).parameters:
                # s3fs sends a HEAD before the GET to split large objects; one request is enough.
                read_kwargs["max_concurrency"] = 1
            self._filesystems[protocol] = (fs, read_kwargs)
        return self._filesystems[protocol]

    def _s3fs_options(self, options: dict[str, Any]) -> None:
        """botocore allows 10 connections by default, which would cap reads in flight, and retries
        by itself, unseen and unbounded by ours: leave retrying to this class."""
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("max_pool_connections", self.io_concurrency)
        config.setdefault("retries", {"total_max_attempts": 1})
        options["config_kwargs"] = config

    def _obstore_options(self, options: dict[str, Any]) -> None:
        """obstore (``obstore.fsspec.register``) retries 10 times by itself and ends every request
        at 30 s: leave retrying to this class and let our read timeout be the one that fires.
        Its HTTP client has no cap on connections."""
        options["retry_config"] = options.get("retry_config") or {"max_retries": 0}
        options["client_options"] = {"timeout": timedelta(seconds=self.timeout + 1), **(options.get("client_options") or {})}

    async def aclose(self) -> None:
        """Closes the async filesystems' HTTP sessions on this loop and stops the executor, the
        latter whatever closing a session raises (a request cut off mid-flight can raise
        CancelledError into it)."""
        try:
            for fs, _ in self._filesystems.values():
                if fs.async_impl:
                    await _close_sessions(fs)
        finally:
            self._filesystems.clear()
            self._blocking.shutdown(SHUTDOWN_WAIT_S)


async def _close_sessions(fs: Any) -> None:
    """fsspec has no public close for async filesystems; these are the clients s3fs, gcsfs and
    http keep. Errors while closing are of no use to anyone and are ignored."""
    try:
        creator = getattr(fs, "_s3creator", None)
        if creator is not None:
            await creator.__aexit__(None, None, None)
        close = getattr(getattr(fs, "_session", None), "close", None)  # aiohttp (http, gcsfs)
        if close is not None and inspect.iscoroutinefunction(close):
            await close()
        # obstore keeps a store, with its pool of connections, per bucket in an lru_cache on the
        # instance (a reference cycle, so dropping the instance would free them only at a GC).
        clear = getattr(getattr(fs, "_construct_store", None), "cache_clear", None)
        if clear is not None:
            clear()
    except Exception:
        pass


def _is_obstore(cls: type) -> bool:
    obstore = sys.modules.get("obstore.fsspec")  # imported if it was registered with fsspec
    return obstore is not None and issubclass(cls, obstore.FsspecStore)


def _as_builtin(error: Exception) -> Exception | None:
    """obstore's errors for what another try cannot fix, as the built-in errors the other fsspec
    filesystems raise (so they are not retried and read the same); None for any other error."""
    kind = type(error)
    builtin = OBSTORE_PERMANENT_ERRORS.get(kind.__name__) if kind.__module__ == "obstore.exceptions" else None
    return None if builtin is None else builtin(str(error))


VERSION_KEYS = ("ETag", "etag", "e_tag", "version_id", "generation", "mtime", "LastModified", "last_modified", "created")


def _version_of(info: dict[str, Any]) -> str:
    """The fields of an fsspec ``info()`` that change when an object is rewritten (they differ
    between filesystems: s3fs's ETag, obstore's e_tag, gcsfs's generation, local mtime)."""
    found = {key: str(info[key]) for key in VERSION_KEYS if info.get(key) is not None}
    return f"size={info.get('size')} " + " ".join(f"{key}={value}" for key, value in sorted(found.items()))


def _protocol(fs: Any) -> str:
    return fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]


def _is_async_callable(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))
