"""The driver: one iteration over an epoch, every policy decided on the user's thread, whatever
moves the samples (one pipeline here, or N child processes: ``pipelines.py``). It takes batches from
the plan (``plan.py``) up to ``window`` ahead, sends their rows out (``dispatch.py``), applies the
failure policy to each answer, hands complete batches out in order (``handout.py``), drops what
``drop_last`` or an empty batch calls for, and records what the user got (``ledger.py``).

The decisions themselves are ``window.py``'s (logic, tested without threads); this class waits
for the pipelines' answers and carries them out.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Iterator

import numpy as np

from ..batch.buffers import BatchBuffer
from ..batch.ragged import take_in
from ..errors import SampleError
from ..order.epoch_size import EpochSize
from ..pipeline.messages import Done, Failed
from ..pipeline.pipelines import ENDED, Backend
from ..settings import LoaderSettings
from .dispatch import Dispatch, pipeline_failed, probe_layout
from .handout import HandOut
from .in_flight import InFlight
from .plan import EpochPlan
from .ledger import EpochLedger
from .window import Window


class EpochDriver:
    """Yields ``(epoch positions, batch)`` for each batch handed out; ``stop()`` ends the run.
    ``rank``: this process's rank in a job of several, put on each failure recorded (None alone)."""

    def __init__(self, backend: Backend, settings: LoaderSettings, epoch: int, order: np.ndarray, ledger: EpochLedger,
                 size: EpochSize, rank: int | None = None) -> None:
        self.pipelines = backend.pipelines
        self.stats = backend.stats
        self.s = settings
        self.order = order
        self.ledger = ledger
        self.plan = EpochPlan(order, ledger.done, size, ledger.batches, settings.skip_errors,
                              settings.max_failures, self.stats, ledger.skipped, ledger.repeated,
                              epoch=epoch, rank=rank)
        self.window = Window(self.plan, ledger, backend.window, settings.in_order)  # the batches under way
        self.handout = HandOut(settings, self.stats, order, backend.device_stage)
        self.pending_copies = self.handout.pending_copies  # the same dict: batch number -> its copy
        self._early_skips: list[int] = []  # skipped while the layout was learnt: go with the first batch
        self._known: dict[int, SampleError] = {}  # positions whose sample failed in the probe
        self._failing: list[tuple[InFlight, int, SampleError]] = []  # their rows, policy to apply
        self._lock = threading.Lock()  # the bookkeeping above, against stop() from another thread
        self._stopped = False  # stop() was called (it may not have finished)
        self._stop_done = False  # every thread has ended and the buffers are accounted for
        self._unfinished: list[BatchBuffer] = []
        self._stats_stopped = False
        self._full = False  # the window is full: the plan waits for the user
        self.run = self.pipelines.new_run()
        self.dispatch = Dispatch(self.pipelines, self.run, order)
        self.stats.run_started()
        try:
            self.dispatch.start(epoch, settings.source, self.plan.undelivered())
            if self.pipelines.ring.layout is not None:
                self._assign()  # the first batches are under way before the first next()
        except BaseException:
            self.stop()
            raise

    # ----- planning -----

    def _assign(self) -> None:
        """Sends new batches to the pipelines while fewer than ``window`` are ahead of the user."""
        window = self.window
        while window.wants_batch():
            positions, repeated = window.next_positions()
            if positions and self.pipelines.ring.layout is None and not self._learn_layout(positions):
                window.exhausted = True
                return
            if not positions:
                break
            with self._lock:
                if self._stopped:
                    raise RuntimeError(ENDED)
                batch = window.add(positions, self.pipelines.ring.take(), repeated, self._early_skips)
                self._early_skips = []
                self._send_rows(batch, list(range(len(positions))))
        with self._lock:
            self._settle_known()
        self._window_full(not window.exhausted)

    def _window_full(self, full: bool) -> None:  # the stats' level of time with the window full ("memory")
        if full != self._full:
            self._full = full
            self.stats.level("producer_waiting", 1 if full else -1)

    def _send_rows(self, batch: InFlight, rows: list[int]) -> None:
        """Sends ``rows`` of ``batch`` to be filled (``dispatch.py``). Rows whose sample the probe
        saw fail are not sent: they take the failure policy in ``_settle_known``."""
        known = [row for row in rows if batch.positions[row] in self._known]
        for row in known:
            self._failing.append((batch, row, self._known.pop(batch.positions[row])))
        batch.settling += len(known)
        rows = [row for row in rows if row not in known] if known else rows
        if batch.moved:
            batch.sending(rows)
        if rows:
            self.dispatch.send(batch, rows)

    def _settle_known(self) -> None:
        """Under the lock: rows whose sample failed in the probe take the failure policy now,
        once the window's batches are planned, when a fill's failures would have."""
        while self._failing:
            batch, row, error = self._failing.pop(0)
            batch.settling -= 1
            self._failed(batch, row, error)
            self._count_ready(batch)

    def _learn_layout(self, positions: list[int]) -> bool:
        """Allocates the ring from the first sample that loads (``dispatch.py``): the first batch's,
        then the cursor's next. False when none can: raising, the first batch carries the
        error; skipping, the epoch delivers nothing (every sample failed)."""
        budget = self.plan.failures_left() if self.s.skip_errors else 0
        layout, self._known = probe_layout(self.pipelines, self.run, self._epoch_ahead(positions), self.order,
                                           self.dispatch.pipeline_for, budget)
        if layout is not None:
            self.pipelines.ring.configure(layout, self.s.batch_size)
            return True
        # Nothing taught the layout: the failures are the policy's now, in the epoch's order.
        for position in sorted(self._known):
            failure = self.plan.record(position, self._known.pop(position))
            if failure is not None:
                self.stats.level("batches_ready", 1)
                with self._lock:
                    self.window.add(positions, None, error=failure)
                return False
            self._early_skips.append(position)
        return False

    def _epoch_ahead(self, positions: list[int]) -> Iterator[int]:  # then the positions after the cursor
        yield from positions
        ahead = 0
        while len(peeked := self.plan.cursor.peek(ahead + 1)) > ahead:
            yield peeked[-1]
            ahead += 1

    # ----- the pipelines' answers -----

    def _answer(self, message: Any) -> None:
        if isinstance(message, Failed):
            raise pipeline_failed(message)
        if not isinstance(message, Done):
            return
        with self._lock:
            if self._stopped:  # stop() from another thread (close()) while this one waited
                raise RuntimeError(ENDED)
            batch = self.dispatch.answered(message.fill)
            if message.side:  # values its rows put aside (batch/ragged.py)
                take_in(self.pipelines.ring, batch.buffer, message.side, self.stats)
            batch.leave_if_poisoned(self.pipelines.ring.take)  # before its failures' replacements are sent
            for row, error in message.failures:
                self._failed(batch, row, error)
            self._settle_known()
            self._count_ready(batch)

    def _count_ready(self, batch: InFlight) -> None:
        """The stats' level of batches complete and not yet handed out."""
        if not batch.counted and batch.complete():
            if batch.moved:
                batch.gather()
            batch.counted = True
            self.stats.level("batches_ready", 1)

    def _failed(self, batch: InFlight, row: int, error: SampleError) -> None:
        """The policy for a failed row (``Window.failed``): a row given the epoch's next
        position is sent again."""
        if self.window.failed(batch, row, error):
            self._send_rows(batch, [row])

    def _take_answers(self) -> None:  # those that have arrived, without waiting
        while (message := self.pipelines.receive(self.run, block=False)) is not None:
            self._answer(message)

    # ----- the user's thread -----

    def __iter__(self) -> Iterator[tuple[list[int], Any]]:
        window = self.window
        while True:
            if self._stopped:
                raise RuntimeError(ENDED)
            self._assign()
            batch = self._wait_for()
            if batch is None:
                return
            verdict, delivered = window.verdict(batch)
            if verdict == "raise":
                if batch.buffer is not None:  # complete (no pipeline writes it): the ring may reuse it
                    batch.buffer.give_back()
                error = batch.first_error()
                assert error is not None
                raise error
            if verdict == "drop":
                self._drop(batch)
                continue
            assert batch.buffer is not None
            out = self.handout.hand_out(batch.number, batch.buffer, batch.positions, batch.holes, self.pipelines.ring.layout)
            window.handed_out(batch, delivered)
            self._assign()
            if self.handout.stage is not None:
                self._take_answers()  # so that batch k+1, if done, is copied now
            self.handout.prefetch_if_complete(window.taken, window.batches.get(window.taken))
            try:
                yield delivered, out
            finally:
                del out
                self.handout.release()  # the user asked for the next batch, or ended the loop

    def _wait_for(self) -> InFlight | None:
        """Blocks until the batch the user gets next (``Window.next_ready``) is complete and
        takes it; None once the epoch has no more batches."""
        started = time.perf_counter()
        while True:
            # Under the lock: with in_order=False, next_ready walks the window's batches, which
            # stop() (close() on another thread) clears; the user then gets the closed error.
            with self._lock:
                if self._stopped:
                    raise RuntimeError(ENDED)
                ready = self.window.next_ready()
                taken = self.window.take(ready) if ready is not None else None
            if taken is not None:
                batch = taken
                self.stats.level("batches_ready", -1)
                break
            if self.window.finished:
                return None
            self._answer(self.pipelines.receive(self.run))
        self.stats.add_batch(len(batch.positions) - len(batch.holes), time.perf_counter() - started, batch.number)
        return batch

    def drain(self) -> None:
        """Assigns no more batches: the iteration ends after those under way (a switch of backends).
        Where the plan was already used up, the batches under way are the epoch's last: its end is
        still announced (``at_end``)."""
        self.window.drain()

    @property
    def at_end(self) -> bool:
        """No batch comes after the one being handed out: the epoch's plan is used up and none is
        under way (Accelerate's ``end_of_dataloader``). A batch that skips leave empty is dropped
        after the fact, so with ``on_error="skip"`` the end may go unannounced."""
        return self.window.at_end

    def _drop(self, batch: InFlight) -> None:
        """A batch that is not delivered: its buffer goes back, its skips stay on the record."""
        assert batch.buffer is not None
        batch.buffer.give_back()
        self.window.dropped(batch)

    def stop(self, timeout: float | None = None) -> None:
        """Ends the run: complete batches go back to the ring now, the others once no pipeline
        writes them any more. Safe to call more than once, from any thread; a stop cut short (a
        thread stuck past the timeout: then a ``RuntimeWarning``) is finished by the next call."""
        if self._stop_done:
            return
        with self._lock:
            first = not self._stopped
            self._stopped = True
            if first:
                for batch in self.window.batches.values():
                    if batch.counted:
                        self.stats.level("batches_ready", -1)
                    if batch.buffer is None or batch.number in self.pending_copies:
                        continue
                    if batch.pending:
                        self._unfinished.append(batch.buffer)
                    else:
                        batch.buffer.give_back()
                self.window.batches.clear()
                self.dispatch.fills.clear()
                self.pending_copies.clear()
        if first:
            self.handout.release()
            self._window_full(False)
        finished = self.pipelines.stop_run(self.run, self._unfinished, timeout)
        if not self._stats_stopped:  # once, whether or not a stuck thread is left: not the run's figures
            self._stats_stopped = True
            self.stats.run_stopped()
        if finished:
            self._unfinished = []  # the pipelines hold them until they are free: the run keeps no buffer
        self._stop_done = finished

