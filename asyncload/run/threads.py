"""Waiting for threads to end, bounded: a thread stuck in a read or a user's decode cannot be
stopped, so every stop waits until a deadline and says which threads are still running."""

from __future__ import annotations

import threading
import time


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
