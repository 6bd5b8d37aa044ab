"""The optional progress bar (``progress=True``)."""

from __future__ import annotations

import os
import shutil
import sys
import time
from typing import IO, Any

from .loader_stats import LoaderStats


class ProgressBar:
    """A tqdm bar over the epoch's samples that also shows the current bottleneck (refreshed at
    most once a second); tqdm hides it when standard error is not a terminal.

    ``total`` is what the epoch will deliver, ``initial`` what it had delivered before this pass
    (a resumed epoch). A skipped sample the epoch had no replacement for leaves the last batch
    short, so ``complete()`` sets the total to what was delivered: a finished epoch reads 100 %.
    """

    def __init__(self, stats: LoaderStats, total: int, epoch: int, initial: int = 0) -> None:
        from tqdm.auto import tqdm  # an optional dependency: imported when a bar is asked for

        self.stats = stats
        columns, rows = screen_size(sys.stderr)
        self.bar = tqdm(total=total, initial=initial, unit="sample", desc=f"epoch {epoch}", file=sys.stderr,
                        disable=None, ncols=columns, nrows=rows)
        self.last_postfix = 0.0

    @classmethod
    def for_pass(cls, stats: LoaderStats, sampler: Any, ledger: Any, epoch: int) -> "ProgressBar":
        """The bar of one pass over ``epoch``: its total is what the epoch delivers (full batches
        only with ``drop_last``), its start what ``ledger`` records as delivered before (a
        resumed epoch, repeats included)."""
        total = sampler.size.delivered
        return cls(stats, total, epoch, len(ledger.done) + len(ledger.repeated))

    def advance(self, samples: int) -> None:
        """``samples`` more were delivered."""
        now = time.monotonic()
        if now - self.last_postfix >= 1.0:
            self.bar.set_postfix_str(f"bottleneck: {self.stats.snapshot().bottleneck}", refresh=False)
            self.last_postfix = now
        self.bar.update(samples)

    def complete(self) -> None:
        """The epoch is done: whatever was skipped, the bar ends full."""
        self.bar.total = self.bar.n
        self.bar.refresh()

    def close(self) -> None:
        """Ends the bar (the epoch ended, or the loop was left)."""
        self.bar.close()


def screen_size(file: IO[str]) -> tuple[int | None, int | None]:
    """tqdm's ``ncols`` and ``nrows`` for ``file``: None lets tqdm ask the terminal itself. A
    terminal that reports a size of 0 x 0 (a pseudo-terminal nobody sized: some CI runners,
    ``docker exec -t``, ``script``) would make tqdm draw at -1 columns, which shows nothing but a
    blank line per epoch; it gets ``COLUMNS`` x ``LINES`` or 80 x 24 instead, less the column tqdm
    leaves free so that a full line does not wrap."""
    try:
        columns, rows = os.get_terminal_size(file.fileno())
    except (AttributeError, OSError, ValueError):
        return None, None  # not a terminal, or no file descriptor: tqdm decides
    if columns > 0 and rows > 0:
        return None, None
    fallback = shutil.get_terminal_size((80, 24))  # COLUMNS and LINES if set, else standard output's
    return max(fallback.columns - 1, 1), max(fallback.lines - 1, 1)
