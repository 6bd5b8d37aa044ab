"""The pipeline's threads: its event loop's, and waiting for threads to end, bounded (a thread
stuck in a read or a user's decode cannot be stopped, so every stop waits until a deadline and
says which threads are still running)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Callable, Coroutine


def wait_ended(threads: list[threading.Thread], deadline: float | None) -> list[threading.Thread]:
    """Waits until ``threads`` have ended or ``deadline`` (``time.monotonic()``; None: no limit)
    has passed; returns those still running. Ended means gone from ``threading.enumerate()``:
    after a join cut short by Ctrl-C, CPython 3.11 marks a thread that is still running as
    stopped, and its ``is_alive()`` and ``join()`` no longer wait for it."""
    while True:
        running = set(threading.enumerate())
        pending = [thread for thread in threads if thread in running and thread is not threading.current_thread()]
        left = 3600.0 if deadline is None else deadline - time.monotonic()
        if not pending or left <= 0:
            return pending
        started = time.monotonic()
        pending[0].join(min(left, 0.05))
        if time.monotonic() - started < 0.005:  # a join that no longer waits: poll instead
            time.sleep(min(left, 0.01))


class LoopThread:
    """An asyncio event loop running on a daemon thread of its own (the pipeline's reads), and
    the two ways other threads reach it."""

    def __init__(self, name: str = "asyncload-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    def call_soon(self, callback: Callable[..., Any], *args: Any) -> None:
        """Runs ``callback(*args)`` on the loop; nothing once the loop has ended."""
        try:
            self.loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:
            pass  # the loop has ended: its owner is closed

    def submit(self, coroutine: Coroutine[Any, Any, Any]) -> bool:
        """Runs ``coroutine`` on the loop; False (the coroutine closed) once the loop has ended."""
        try:
            asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        except RuntimeError:
            coroutine.close()
            return False
        return True
