"""A pass over the loader: the driver of its epoch, the loop that hands its batches to the user
(telling the tuner and the progress bar), and its stop. The loader keeps one ``Passes``: a new
pass stops the one still running, and ``close()`` the last.

With ``processes=None`` a pass may change backends at a batch boundary (``switch.py`` says
when): its driver is drained (the batches under way are handed out), stopped, and a new driver
on the new backend goes on over the epoch's ledger, as a resume would: the same batches, in
the same order, nothing read twice.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterator

from ..pipeline.pipelines import Backend
from ..settings import LoaderSettings
from ..stats.bar import ProgressBar
from ..trainers import EpochEnd
from .driver import EpochDriver
from .ledger import Epochs, EpochLedger


class Passes:
    """Which pass is running (``driver``), over the epochs of ``epochs``."""

    def __init__(self, epochs: Epochs) -> None:
        self.epochs = epochs
        self.driver: EpochDriver | None = None

    def start(self, backend: Backend, settings: LoaderSettings, sampler: Any, tuner: Any, bar: bool,
              owner: Any = None, switch: Any = None) -> Iterator[Any]:
        """A new pass: the epoch ``epochs`` says, or the rest of one. Called at the pass's first
        ``next()`` (``AsyncLoader.__iter__`` returns a generator whose body calls it), so nothing
        is read before then; from here its first batches are under way, ``prefetch`` ahead, while
        the first is awaited. The pass holds ``owner`` (the
        loader) while it runs: ``for batch in AsyncLoader(...)`` keeps no other reference, and a
        collected loader closes itself. ``switch``: ``processes=None``'s (``due()``, ``take()``
        the new backend, ``retire()`` the old one, ``backend.stats``: the loader's tuner follows)."""
        self.stop()  # a new iteration replaces an unfinished one
        epoch, ledger = self.epochs.start_pass(), self.epochs.ledger
        order, size = self.epochs.plan(sampler, epoch)  # the epoch's, or an elastic rest
        driver = EpochDriver(backend, settings, epoch, order, ledger, size,
                             rank=sampler.rank if sampler.world_size > 1 else None)
        self.driver = driver
        iteration = self._iterate(driver, epoch, ledger, sampler, settings, tuner,
                                  backend.stats if bar else None, owner, switch)
        # The threads start now, but a generator dropped before its first next() never runs its
        # `finally`: stop them when it goes, whether it ran or not.
        weakref.finalize(iteration, stop_unless_stopped, driver)
        return iteration

    def _iterate(self, driver: EpochDriver, epoch: int, ledger: EpochLedger, sampler: Any, settings: LoaderSettings,
                 tuner: Any, bar_stats: Any, owner: Any, switch: Any) -> Iterator[Any]:  # owner: kept alive
        bar = ProgressBar.for_pass(bar_stats, sampler, ledger, epoch) if bar_stats is not None else None
        end = EpochEnd()  # Accelerate's gradient accumulation syncs at the epoch's last batch
        try:
            while True:
                draining = False
                for positions, batch in driver:  # the driver records what was handed out in ledger
                    if tuner is not None:
                        tuner.observe()
                    if bar is not None:
                        bar.advance(len(positions))
                    if driver.at_end:
                        end.last()
                    yield batch
                    del batch  # not kept by this frame while the next one is awaited: its buffer may be reused
                    if not draining and switch is not None and switch.due():
                        driver.drain()  # the batches under way are handed out, then the backend changes
                        draining = True
                if not draining:
                    break
                driver, tuner = self._switched(driver, epoch, ledger, sampler, settings, switch, owner)
                if bar is not None:
                    bar.stats = driver.stats  # the bottleneck it shows is the new backend's
            self.epochs.pass_ended(epoch, latest=self.driver is driver)
            if bar is not None:
                bar.complete()
        finally:
            end.end()
            driver.stop()
            if self.driver is driver and driver._stop_done:  # else close() finishes the stop
                self.driver = None
            if bar is not None:
                bar.close()

    def _switched(self, driver: EpochDriver, epoch: int, ledger: EpochLedger, sampler: Any, settings: LoaderSettings,
                  switch: Any, owner: Any) -> tuple[EpochDriver, Any]:
        """The drained ``driver`` stops; a new one on the switch's new backend goes on over the
        epoch's ledger; the old backend is closed once its run has stopped."""
        driver.stop()
        backend = switch.take()  # the loader's backend, stats and tuner from now on
        switch.retire()
        order, size = self.epochs.plan(sampler, epoch)
        driver = EpochDriver(backend, settings, epoch, order, ledger, size,
                             rank=sampler.rank if sampler.world_size > 1 else None)
        self.driver = driver
        return driver, getattr(owner, "tuner", None)

    def stop(self) -> None:
        """Stops the pass still running, if any."""
        driver = self.driver
        if driver is not None:
            driver.stop()  # a Ctrl-C here leaves self.driver set: the next close() finishes the stop
            if driver._stop_done:
                self.driver = None


def stop_unless_stopped(driver: EpochDriver) -> None:
    """A dropped iteration's pass is stopped, unless its own ``finally`` already tried: a stop that
    timed out waited once, and garbage collection must not wait again (``close()`` finishes it)."""
    if not driver._stopped:
        driver.stop()
