"""Gates: how many threads (``Gate``) or coroutines (``AsyncGate``) may work at once, a limit
that may change while they wait. The tuner moves them (``autotune.py``); the decode threads
(``pipeline/workers.py``) and the shard stream's reads (``sources/shard_stream.py``) pass them.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any


class Gate:
    """Lets at most ``limit`` threads through at once; the limit may change while threads wait."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._inside = 0
        self._cond = threading.Condition()

    def set_limit(self, limit: int) -> None:
        with self._cond:
            self._limit = limit
            self._cond.notify_all()

    def __enter__(self) -> None:
        with self._cond:
            while self._inside >= self._limit:
                self._cond.wait()
            self._inside += 1

    def __exit__(self, *exc: Any) -> None:
        with self._cond:
            self._inside -= 1
            self._cond.notify()


class AsyncGate:
    """Like ``Gate`` for coroutines on one event loop: at most ``limit`` holders at once."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.inside = 0
        self._freed = asyncio.Event()

    async def acquire(self) -> None:
        while self.inside >= self.limit:
            self._freed.clear()
            await self._freed.wait()
        self.inside += 1

    def release(self) -> None:
        self.inside -= 1
        self._freed.set()

    def set_limit(self, limit: int) -> None:
        self.limit = limit
        self._freed.set()
