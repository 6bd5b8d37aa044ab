"""A gate that calls in any process block on until the test opens it: a file the test creates.

A stuck read or decode in a test waits here, not in a sleep of a guessed length, so what the test
checks happens while it is stuck, however busy the machine; the test waits for the marks the
calls leave (``waiting``, ``done``) instead of sleeping until they are likely there.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

POLL_S = 0.02  # how often a call at the gate looks whether it opened


class Gate:
    """Blocks until the file at ``path`` exists (the test creates it: ``open``)."""

    def __init__(self, path: Path | str) -> None:
        self.path = str(path)

    def wait(self, index=None, seconds: float | None = None) -> None:
        """Blocks until the gate opens (or ``seconds`` pass: a bound so that a call the test forgot
        ends by itself); first marks that ``index`` is waiting (see ``waiting``)."""
        if index is not None:
            Path(f"{self.path}.waiting-{index}").touch()
        until = None if seconds is None else time.monotonic() + seconds
        while not os.path.exists(self.path) and (until is None or time.monotonic() < until):
            time.sleep(POLL_S)

    def open(self) -> None:
        Path(self.path).touch()

    def waiting(self, index) -> bool:
        """Whether a call for ``index`` has reached the gate (in any process)."""
        return os.path.exists(f"{self.path}.waiting-{index}")

    def mark_done(self, index) -> None:
        """Marks that the call for ``index``, let go, has done what it does after the gate."""
        Path(f"{self.path}.done-{index}").touch()

    def done(self, index) -> bool:
        """Whether the call for ``index`` has marked itself done (in any process)."""
        return os.path.exists(f"{self.path}.done-{index}")
