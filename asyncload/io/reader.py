"""Reads on one asyncio event loop: fsspec filesystems, retries with backoff, a timeout per read.

Object stores go through obstore where it can serve them (``object_store``), the rest through
fsspec. Async filesystems (obstore, s3fs, gcsfs, http) are awaited natively, so hundreds of
requests wait on the network at once from one thread; sync ones run on a small executor.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import sys
import time
from typing import Any, Awaitable, Callable

from fsspec.core import split_protocol

from ..stats.loader_stats import LoaderStats
from . import limits, object_store
from .blocking import BlockingCalls, timeout_error
from .retries import RetryBudget, is_transient, note_attempt, retried

LOCAL_PROTOCOLS = ("file", "local", "memory")
TIMEOUT_NAME = "read_timeout"  # the user's name for ``Reader.timeout``, in the message of a read that timed out
# How long closing waits for reads still running: their callers are gone, stuck ones are left to
# end by themselves. An idle thread ends at once, but on a loaded machine may wait over a second to run.
SHUTDOWN_WAIT_S = 5.0


class Reader:
    """Fetches items on the event loop ``loop``; create and use it on that loop's thread."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        storage_options: dict[str, Any] | None,
        timeout: float,
        retries: int | None,
        io_concurrency: int,
        stats: LoaderStats,
        user_read: Callable[[Any], Any] | None = None,
        retry_seconds: float = 60.0,
        max_bytes: int | None = None,
    ) -> None:
        self.loop = loop
        self.storage_options = storage_options or {}
        self.timeout = timeout
        self.budget = RetryBudget(retries, retry_seconds)
        self.max_bytes = max_bytes  # one object's size budget (max_sample_bytes; see limits.py)
        self.stats = stats
        self.user_read = user_read
        self.io_concurrency = io_concurrency
        self._user_read_is_async = user_read is not None and _is_async_callable(user_read)
        # Sync reads (user functions, sync remote filesystems, local files) wait here; 32 threads
        # are plenty to wait on and few enough not to crowd the decode threads out of the GIL.
        # Each read's timeout counts from its start on a thread, and stuck reads cannot fill it.
        self._blocking = BlockingCalls(min(io_concurrency, 32), "asyncload-read", TIMEOUT_NAME)
        self._filesystems: dict[str, Any] = {}

    async def read(self, key: Any) -> Any:
        """The bytes at URL ``key`` (or what the user's ``read`` returns for it), retried on
        transient errors with backoff and jitter within the retry budget (see ``retries.py``),
        at most ``max_bytes`` of them (``limits.SampleTooLarge``)."""
        data = await self._counted(lambda: self._fetch(key), key=key)
        return limits.checked(data, self.max_bytes, key if isinstance(key, str) else limits.READ_RESULT)

    async def read_range(self, url: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``url`` in one ranged request, retried as ``read`` is."""
        return await self._counted(lambda: self._fetch_file(url, start=start, end=end), f"bytes {start}-{end} of {url}")

    async def _counted(self, fetch: Callable[[], Awaitable[Any]], what: str | None = None, key: Any = None) -> Any:
        """``fetch()`` with retries, counted in the stats (and the trace: ``key``, else ``what``)."""
        started = time.perf_counter()
        self.stats.level("reads_in_flight", 1)
        try:
            data = await self._with_retries(fetch, what)
        finally:
            self.stats.level("reads_in_flight", -1)
        nbytes = len(data) if isinstance(data, (bytes, bytearray, memoryview)) else 0
        ended = time.perf_counter()
        self.stats.add("read", ended - started, nbytes)
        if self.stats.tracer is not None:  # reads overlap on the loop's thread: an async span
            self.stats.tracer.async_span("read", started, ended, key if key is not None else what)
        return data

    async def _with_retries(self, fetch: Callable[[], Awaitable[Any]], what: str | None = None) -> Any:
        """``fetch()``, tried again after transient errors within the budget (``retries.retried``)."""
        return await retried(fetch, self.budget, what, self.stats.add_retry)

    def is_local(self, key: Any) -> bool:
        """True for URLs on local disk or in memory. These are read by the decode thread itself
        (``read_local``): a page-cache read costs tens of microseconds, less than handing the
        sample from an I/O thread through the event loop to a decode thread."""
        if self.user_read is not None or not isinstance(key, str):
            return False
        if (split_protocol(key)[0] or "file") not in LOCAL_PROTOCOLS:
            return False  # a remote client is made (its options checked) at its first read, retried
        fs, _ = self._filesystem(key)
        return not fs.async_impl and _protocol(fs) in LOCAL_PROTOCOLS

    def read_local(self, key: str) -> bytes:
        """Reads a local URL for the calling (decode) thread (see ``is_local``), on a read
        thread so that a read that hangs (a stuck network mount, a FIFO) fails after the read
        timeout, as remote reads do, instead of holding the decode thread and its row for ever.
        Not retried: a local file that did not answer within the timeout will not soon. Read
        no further than ``max_bytes`` (``/dev/zero`` is endless)."""
        started = time.perf_counter()
        fs, _ = self._filesystems[split_protocol(key)[0] or "file"]
        path = fs._strip_protocol(key)
        self.stats.level("reads_in_flight", 1)
        try:
            if _protocol(fs) == "memory":  # held in memory already: measured after
                data = limits.checked(fs.cat_file(path), self.max_bytes, key)
            else:
                data = self._blocking.call(limits.read_file, path, self.max_bytes, timeout=self.timeout)
        except Exception as error:
            note_attempt(error, 1, 1, None, transient=is_transient(error))
            raise
        finally:
            self.stats.level("reads_in_flight", -1)
        ended = time.perf_counter()
        self.stats.add("read", ended - started, len(data))
        if self.stats.tracer is not None:
            self.stats.tracer.span("read", started, ended, key)
        return data

    def _fetch(self, key: Any) -> Awaitable[Any]:
        if self.user_read is not None:
            if self._user_read_is_async:
                return within(self.user_read(key), self.timeout)
            return self._blocking.call_async(self.user_read, key, timeout=self.timeout)
        return self._fetch_file(key)

    def _fetch_file(self, url: str, **byte_range: int) -> Awaitable[bytes]:
        """The bytes of ``url`` (``start``/``end``: of that range) through its filesystem."""
        fs, cat = self._filesystem(url)
        path = fs._strip_protocol(url)
        bucket = object_store.region_to_find(fs, path)
        if bucket is not None:  # asked once per bucket, off the loop, within the read's timeout
            return self._after_region(bucket, lambda: self._fetch_file(url, **byte_range))
        if cat is not None:
            return within(cat(path, **byte_range), self.timeout)
        return self._blocking.call_async(functools.partial(fs.cat_file, path, **byte_range), timeout=self.timeout)

    async def _after_region(self, bucket: str, then: Callable[[], Awaitable[Any]]) -> Any:
        """Asks S3 for ``bucket``'s region on an I/O thread (a blocking HEAD the client would
        otherwise send from the event loop, stalling every read), then runs ``then``."""
        await self._blocking.call_async(object_store.bucket_region, bucket, timeout=self.timeout)
        return await then()

    async def version(self, url: str) -> str:
        """What identifies the current content of ``url``: its ETag, else its modification
        time, with its size (one metadata request, retried as reads are; not counted as one)."""
        fs, _ = self._filesystem(url)
        path = fs._strip_protocol(url)
        bucket = object_store.region_to_find(fs, path)
        if bucket is not None:
            await self._blocking.call_async(object_store.bucket_region, bucket, timeout=self.timeout)
        if fs.async_impl:
            info = await self._with_retries(lambda: within(fs._info(path), self.timeout))
        else:
            info = await self._with_retries(lambda: self._blocking.call_async(fs.info, path, timeout=self.timeout))
        return version_of(info)

    async def run_blocking(self, function: Callable[..., Any], *args: Any) -> Any:
        """Runs ``function(*args)`` on the I/O threads (file work that must not block the loop),
        with no timeout: cache work on local disk, which must not be abandoned half done."""
        return await asyncio.wrap_future(self._blocking.submit(function, *args).future)

    def _filesystem(self, url: str) -> tuple[Any, Callable[..., Awaitable[bytes]] | None]:
        """The filesystem for ``url``'s protocol (one instance per protocol, bound to our loop;
        obstore for object stores where it can serve them, see ``object_store``) and, for an
        asynchronous one, how to read ``(path, start=, end=)`` from it in a single request."""
        protocol = split_protocol(url)[0] or "file"
        if protocol not in self._filesystems:
            fs = object_store.filesystem(protocol, self.storage_options, loop=self.loop, read_timeout=self.timeout,
                                         connections=self.io_concurrency)
            self._filesystems[protocol] = (fs, one_request_read(fs, self.max_bytes))
        return self._filesystems[protocol]

    async def aclose(self) -> None:
        """Closes the async filesystems' HTTP sessions on this loop and stops the executor, the
        latter whatever closing a session raises (a request cut off mid-flight can raise
        CancelledError into it)."""
        try:
            for fs, _ in self._filesystems.values():
                if fs.async_impl:
                    await object_store.close_sessions(fs)
        finally:
            self._filesystems.clear()
            self._blocking.shutdown(SHUTDOWN_WAIT_S)


def one_request_read(fs: Any, max_bytes: int | None = None) -> Callable[..., Awaitable[bytes]] | None:
    """How to read ``(path, start=, end=)`` from async filesystem ``fs`` in a single request
    (None for a synchronous one): obstore's one ranged GET (``object_store.cat``, which reads a
    whole object no further than ``max_bytes``), or s3fs's ``_cat_file``, told not to send its
    HEAD before the GET and bounded the same way (``object_store.bounded_cat``), or another
    filesystem's ``_cat_file`` (its result is checked once read: ``Reader.read``)."""
    if object_store.is_obstore(fs):
        return functools.partial(object_store.cat, fs, limit=max_bytes)
    if not fs.async_impl:
        return None
    if "max_concurrency" in inspect.signature(fs._cat_file).parameters:
        # s3fs sends a HEAD before the GET to split large objects; one request is enough.
        if max_bytes is not None:
            return functools.partial(object_store.bounded_cat, fs, max_bytes)
        return functools.partial(fs._cat_file, max_concurrency=1)
    return fs._cat_file


async def within(awaitable: Awaitable[Any], timeout: float) -> Any:
    """``await awaitable``, cancelled with ``TimeoutError`` after ``timeout`` seconds (the read
    timeout: the error says so, where asyncio's own says nothing). Python 3.11's ``asyncio.timeout``
    costs a timer; ``wait_for`` there also wraps the awaitable in a task of its own, which at
    thousands of reads a second is Python the one event loop cannot spare."""
    if sys.version_info < (3, 11):
        try:
            return await asyncio.wait_for(awaitable, timeout)
        except asyncio.TimeoutError:
            raise timeout_error(TIMEOUT_NAME, timeout) from None
    scope = asyncio.timeout(timeout)
    try:
        async with scope:
            return await awaitable
    except TimeoutError:
        if not scope.expired():
            raise  # the awaitable's own
        raise timeout_error(TIMEOUT_NAME, timeout) from None


VERSION_KEYS = ("ETag", "etag", "e_tag", "version_id", "generation", "mtime", "LastModified", "last_modified", "created")


def version_of(info: dict[str, Any]) -> str:
    """The fields of an fsspec ``info()`` that change when an object is rewritten (they differ
    between filesystems: s3fs's ETag, obstore's e_tag, gcsfs's generation, local mtime)."""
    found = {key: str(info[key]) for key in VERSION_KEYS if info.get(key) is not None}
    return f"size={info.get('size')} " + " ".join(f"{key}={value}" for key, value in sorted(found.items()))


def _protocol(fs: Any) -> str:
    return fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]


def _is_async_callable(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))
