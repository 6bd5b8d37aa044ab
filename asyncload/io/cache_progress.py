"""Reads served from a shard's download while it is still under way in this process.

A shard is downloaded whole before it is installed, but a chunk of it need not wait for the
rest: the cold epoch would decode nothing of a shard until its last byte came (the issue measured
the cache's cold epoch at 0.88x of no cache). So each download of this process publishes how far
its file is written, and a read whose bytes are all written reads them from that file at once
(from the page cache: the bytes it was just given). Those bytes count as read from storage
(no kept copy to blame if they fail to decode). Reads of a shard a peer process downloads wait
for its copy, as before.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, Awaitable, Callable

Finish = Callable[..., Awaitable[Any]]  # ShardCache._finish: thread work a cancel lets end first


class Progress:
    """One download's file, open for reading, and how many of its first bytes are written."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.written = 0
        self.held: tuple[int, bytes] | None = None  # (start, bytes) of the chunk being written now
        self.done = False
        self._users = 0  # reads on a thread now: the descriptor is closed only after them

    async def read(self, start: int, end: int, finish: Finish) -> bytes:
        self._users += 1
        try:
            return await finish(os.pread, self.fd, end - start, start)
        finally:
            self._users -= 1
            self.close_if_unused()

    def close_if_unused(self) -> None:
        if self.done and not self._users and self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Downloads:
    """This process's downloads in progress, by URL, and a signal at each step of any of them."""

    def __init__(self) -> None:
        self._by_url: dict[str, Progress] = {}
        self._changed: asyncio.Future | None = None

    def start(self, url: str, fd: int) -> Progress:
        progress = self._by_url[url] = Progress(fd)
        self._notify()
        return progress

    def hold(self, progress: Progress, start: int, data: bytes) -> None:
        """``data``, downloaded from ``start``, is being written: reads within it need not wait
        for the disk (a busy one took seconds for a 16 MB write)."""
        progress.held = (start, data)
        self._notify()

    def advance(self, progress: Progress, written: int) -> None:
        progress.written, progress.held = written, None
        self._notify()

    def end(self, url: str, progress: Progress) -> None:
        if self._by_url.get(url) is progress:
            del self._by_url[url]
        progress.done = True
        progress.close_if_unused()
        self._notify()

    async def serve(self, url: str, start: int, end: int, ensuring: asyncio.Future, finish: Finish) -> bytes | None:
        """Bytes ``[start, end)`` of ``url`` from its download in progress, as soon as they are
        written; None once ``ensuring`` (the read's wait for the whole copy) ends first."""
        while not ensuring.done():
            progress = self._by_url.get(url)
            held = None if progress is None else progress.held
            if held is not None and held[0] <= start and end <= held[0] + len(held[1]):
                return held[1] if (start, end) == (held[0], held[0] + len(held[1])) else \
                    bytes(memoryview(held[1])[start - held[0]:end - held[0]])
            if progress is not None and progress.written >= end and progress.fd >= 0:
                return await progress.read(start, end, finish)
            loop = asyncio.get_running_loop()
            if self._changed is None or self._changed.get_loop() is not loop:
                self._changed = loop.create_future()
            await asyncio.wait({ensuring, self._changed}, return_when=asyncio.FIRST_COMPLETED)
        return None

    def _notify(self) -> None:
        if self._changed is not None:
            if not self._changed.done():
                self._changed.set_result(None)
            self._changed = None
