"""Storage that cannot be asked about an object: both caches then serve their kept copies unasked.

A cache asks storage for an object's version before it trusts its copy. When that question fails
transiently (storage down, the network cut), a copy whose checksum holds is used without asking
again for ``OFFLINE_S``, then storage is asked again; one warning per cache folder says so. A
failure that is not transient (the object gone, access denied, a bug) is raised: that is an
answer, not storage that cannot be asked. The shard cache (``shards.py``) and the item cache
(``items.py``) keep this one rule."""

from __future__ import annotations

import time
from typing import Any, Awaitable, Callable

from ..errors import describe
from ..redact import shown
from ..io.retries import is_transient

OFFLINE_S = 60.0  # after storage could not be asked: kept copies are used this long without asking


class OfflineWindow:
    """``asked(url, question)``: storage's answer, or none while storage cannot be asked.

    ``warn(reason, message)`` is the cache's own once-per-folder warning."""

    def __init__(self, warn: Callable[[str, str], None]) -> None:
        self.until = 0.0  # kept copies are used unasked till then (time.monotonic())
        self._warn = warn

    def now(self) -> bool:
        """Whether storage is taken as offline now (a question failed less than OFFLINE_S ago)."""
        return time.monotonic() < self.until

    async def asked(self, url: str, question: Callable[[], Awaitable[Any]]) -> tuple[bool, Any]:
        """``(True, answer)``, or ``(False, None)`` while storage is offline or when ``question``
        fails transiently (which opens the window and warns)."""
        if self.now():
            return False, None
        try:
            return True, await question()
        except Exception as error:
            if not is_transient(error):  # gone, denied, or a bug: not storage that cannot be asked
                raise
            self.until = time.monotonic() + OFFLINE_S
            self._warn("offline", f"storage could not be asked about {shown(url)} ({describe(error)}); kept "
                                  f"copies whose checksum holds are used for {OFFLINE_S:.0f} s before asking again")
            return False, None
