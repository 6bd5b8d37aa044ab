"""The optional progress bar (``progress=True``)."""

from __future__ import annotations

import sys
import time

from .figures import LoaderStats


class ProgressBar:
    """A tqdm bar over the epoch's samples that also shows the current bottleneck (refreshed at
    most once a second); tqdm hides it when standard error is not a terminal."""

    def __init__(self, stats: LoaderStats, samples: int, epoch: int) -> None:
        from tqdm.auto import tqdm  # an optional dependency: imported when a bar is asked for

        self.stats = stats
        self.bar = tqdm(total=samples, unit="sample", desc=f"epoch {epoch}", file=sys.stderr, disable=None)
        self.last_postfix = 0.0

    def advance(self, samples: int) -> None:
        """``samples`` more were delivered."""
        now = time.monotonic()
        if now - self.last_postfix >= 1.0:
            self.bar.set_postfix_str(f"bottleneck: {self.stats.snapshot().bottleneck}", refresh=False)
            self.last_postfix = now
        self.bar.update(samples)

    def close(self) -> None:
        """Ends the bar (the epoch ended, or the loop was left)."""
        self.bar.close()
