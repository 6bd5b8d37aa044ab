"""One iteration over an epoch in this process: the wiring of the plan, the producer on its
event-loop thread, the decode threads, the board of complete batches and the hand-out.

Read it top-down: ``plan.py`` decides positions and failures, ``producer.py`` issues reads and
decode jobs on the loop, ``jobs.py`` (on ``workers.py``'s threads) writes rows, ``board.py``
passes complete batches to the user's thread, ``handout.py`` turns them into the user's batch.
"""

from __future__ import annotations

import asyncio
import threading
import time
import warnings
from typing import Any, Callable, Iterator

import numpy as np

from ..order.positions import Positions
from .board import ENDED, Board
from .handout import HandOut
from .jobs import Batch
from .plan import EpochPlan
from .producer import Producer, call_in_loop
from .settings import BatchQuota, Settings

STOP_TIMEOUT_S = 20.0  # how long stop() waits for the threads: a read's timeout is on its own threads


class EpochRun:
    """Delivers the batches of one epoch's ``order`` (source indices), leaving out the positions
    in ``done``. Iterate it on the user's thread; ``stop()`` ends every thread it started.

    With a ``quota`` the run delivers exactly ``quota.count`` batches (see ``EpochPlan``);
    ``skipped``: positions an earlier run of this epoch skipped (a resume)."""

    def __init__(self, settings: Settings, epoch: int, order: np.ndarray, done: Positions,
                 quota: BatchQuota | None = None, skipped: Positions | None = None) -> None:
        self.s = settings
        self.epoch = epoch
        self.order = order
        self.plan = EpochPlan(order, done, quota, settings.batch_size, settings.drop_last, settings.skip_errors,
                              settings.max_failures, settings.stats, skipped)
        self.skipped_delivered: list[int] = []  # skipped positions of the batches handed out, for the state
        self.loop = asyncio.new_event_loop()
        self.board = Board(settings.stats)
        self.producer = Producer(settings, epoch, self.plan, self.board, self.loop)
        self.handout = HandOut(settings)
        self._stop_done = False  # every thread has ended and the run's state is released
        self._stopped = False  # stop() was called (it may not have finished)
        settings.stats.run_started()
        self._main = self.loop.create_task(self.producer.produce_all())
        self.thread = threading.Thread(target=self._run_loop, name="asyncload-loop", daemon=True)
        self.thread.start()

    @property
    def failures(self) -> list:
        """The failures recorded so far in this run."""
        return self.plan.failures

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        fatal: BaseException | None = None
        try:
            self.loop.run_until_complete(self._main)
        except BaseException as error:  # cancelled by stop(), or a bug: the consumer must know
            if not isinstance(error, asyncio.CancelledError):
                fatal = error
        finally:
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()
            self.board.loop_ended(fatal)

    def set_io_limit(self, limit: int) -> None:
        """Changes how many reads may be in flight, from any thread."""
        self._call_in_loop(lambda: self.producer.set_io_limit(limit))

    def _call_in_loop(self, callback: Callable[[], Any]) -> None:
        call_in_loop(self.loop, callback)

    # ----- the user's thread -----

    def __iter__(self) -> Iterator[tuple[list[int], Any]]:
        """Yields ``(epoch positions, batch)`` for each complete batch."""
        number = 0
        while True:
            if self.board.stopped:
                raise RuntimeError(ENDED)
            batch = self._wait_for(number if self.s.in_order else None)
            if batch is None:
                return
            error = batch.first_error()
            if error is not None:
                raise error
            if batch.holes and self.s.drop_last and self.plan.quota is None:
                self._drop(batch)  # skips left it short and the epoch has no sample left for it
                number += 1
                continue
            assert batch.buffer is not None
            out = self.handout.hand_out(batch.number, batch.buffer, len(batch.positions), batch.holes)
            self._left_pipeline(batch)
            self.skipped_delivered += batch.skipped + self.producer.skipped_early
            self.producer.skipped_early = []
            number += 1
            self._prefetch_copy(number)
            try:
                yield [p for row, p in enumerate(batch.positions) if row not in batch.holes], out
            finally:
                del out
                self.handout.release()  # the user asked for the next batch, or ended the loop

    def _wait_for(self, number: int | None) -> Batch | None:
        """Blocks until batch ``number`` (or, with None, any batch) is complete; None once the
        epoch has no more batches."""
        started = time.perf_counter()
        batch = self.board.take(number)
        if batch is not None:
            self.s.stats.add_batch(len(batch.positions) - len(batch.holes), time.perf_counter() - started)
        return batch

    def _left_pipeline(self, batch: Batch) -> None:
        """``batch`` was handed out or dropped: it frees its place in the prefetch window."""
        self.producer.in_pipeline.remove(batch)
        self.board.handed_out += 1
        self._call_in_loop(self.producer.room.set)

    def _drop(self, batch: Batch) -> None:
        """With ``drop_last``: a batch that cannot be filled is not delivered (its good samples
        are the epoch's dropped rest, as ``drop_last`` drops a short last batch)."""
        assert batch.buffer is not None
        batch.buffer.give_back()
        self.skipped_delivered += batch.skipped
        self._left_pipeline(batch)

    def _prefetch_copy(self, number: int) -> None:
        """With a device stage: if batch ``number`` is already complete, start its copy now."""
        if not self.handout.wants_copy(number):
            return
        batch = self.board.peek(number)
        if batch is not None and not batch.errors and not batch.holes:
            assert batch.buffer is not None
            self.handout.prefetch_copy(number, batch.buffer, len(batch.positions))

    def stop(self, timeout: float | None = None) -> None:
        """Ends the event loop and the decode threads, and returns unused buffers to the ring.
        Safe to call more than once and from ``__del__``; waits at most about ``timeout`` s.
        A stop cut short (Ctrl-C while it waits, or a thread stuck in a read or a user's
        decode past the timeout: then a ``RuntimeWarning``) is finished by the next call.
        Buffers go back to the ring only once no decode thread can write into them."""
        if self._stop_done:
            return
        self._stopped = self.board.stopped = self.producer.stopped = True
        self.handout.release()
        self._call_in_loop(self._main.cancel)
        timeout = STOP_TIMEOUT_S if timeout is None else timeout
        deadline = time.monotonic() + timeout
        workers = self.producer.workers
        _wait_ended([self.thread], deadline)
        workers.stop()  # no queued job starts; the threads end after the one they run
        _wait_ended(workers.all_threads()[:1], deadline)  # the starter: then the list is whole
        threads = [self.thread, *workers.all_threads()]
        alive = [thread.name for thread in _wait_ended(threads, deadline)]
        if alive:
            warnings.warn(f"asyncload: {len(alive)} threads still running {timeout:g} s after stop() "
                          f"({', '.join(alive)}); a later stop() or close() finishes the job", RuntimeWarning)
            self.s.stats.run_stopped()  # its probe thread too: the stuck threads are not the run's figures
            return
        self._stop_done = True
        for batch in self.producer.in_pipeline:
            if batch.buffer is not None and batch.number not in self.handout.pending_copies:
                batch.buffer.give_back()
        self.producer.in_pipeline.clear()
        self.handout.pending_copies.clear()
        self.board.clear()
        self.s.stats.run_stopped()


def _wait_ended(threads: list[threading.Thread], deadline: float) -> list[threading.Thread]:
    """Waits until ``threads`` have ended or ``deadline`` (``time.monotonic()``) has passed;
    returns those still running. Ended means gone from ``threading.enumerate()``: after a join
    cut short by Ctrl-C, CPython 3.11 marks a thread that is still running as stopped, and its
    ``is_alive()`` and ``join()`` no longer wait for it."""
    while True:
        running = set(threading.enumerate())
        pending = [thread for thread in threads if thread in running]
        left = deadline - time.monotonic()
        if not pending or left <= 0:
            return pending
        started = time.monotonic()
        pending[0].join(min(left, 0.05))
        if time.monotonic() - started < 0.005:  # a join that no longer waits: poll instead
            time.sleep(min(left, 0.01))
