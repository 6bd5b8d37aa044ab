"""``isolate=True``: the whole pipeline runs in one child process, out of the training process.

In-process decode threads share the training process's cores and its GIL: a training step that
runs Python (a data-parallel wrapper, a Python-heavy model, logging) is slowed by them, and they
by it. Here one child, started with ``spawn`` (never fork: the parent has threads and maybe
CUDA), runs an ordinary ``AsyncLoader`` (``isolate_child.py``) whose batch buffers are
shared-memory segments (``shm.py``); decode threads write each sample straight into them, and
the parent maps each segment once and hands out views of it, pinned for the GPU when CUDA is
there. The pipe carries only control data: segment announcements (with their descriptors),
which buffer a batch is in, its rows and epoch positions, errors, and a stats snapshot; never
batch data. This module holds the messages and the parent's side.

The parent owns the epoch and resume state (``AsyncLoader`` keeps them as usual) and sends them
with each iteration. A buffer leaves the user only when nothing holds its memory any more: the
parent tells the child which buffers were released (the storage use count test of
``BatchBuffer.is_free``), and until then the child keeps views of them, so its own ring does not
reuse them and allocates a new segment when none is free.

Shutdown: ``close()``/garbage collection tell the child to stop and wait briefly, then kill it;
the child exits when its parent dies (a thread of its own waits for that and nothing else); if
the child dies, the parent raises a ``RuntimeError`` rather than wait. Segments need no cleanup
in any of these cases.
"""

from __future__ import annotations

import itertools
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import threading
import time
import weakref
from dataclasses import dataclass
from multiprocessing import reduction
from typing import Any, Iterator, NoReturn

import torch

from . import shm
from .buffers import BatchBuffer, SampleLayout
from .device import convert_batch
from .pipeline import Settings
from .stats import Failure, LoaderStats

CLOSE_TIMEOUT_S = 2.0  # close(): how long the child may take to stop before it is killed


# ----- messages (parent -> child) -----


@dataclass
class Run:
    """Start an iteration: ``state`` is the parent's ``state_dict()`` (epoch, delivered);
    segments ``released`` are free again (before the new iteration takes buffers)."""

    run: int
    state: dict[str, Any]
    released: list[int]


@dataclass
class Want:
    """The user asked for the next batch of ``run``; segments ``released`` are free again."""

    run: int
    released: list[int]


@dataclass
class Stop:
    """The user left iteration ``run`` (break, exception, new iteration)."""

    run: int
    released: list[int]


@dataclass
class Close:
    pass


# ----- messages (child -> parent) -----


@dataclass
class Report:
    """Sent with every batch: the child's stats, failures new since the last report, and the
    segments the child dropped (the parent unmaps them once its user has let go too)."""

    figures: dict[str, Any]
    failures: list[Failure]
    forgotten: list[int]


@dataclass
class Segment:
    """A new shared-memory buffer; its descriptor follows on the pipe."""

    id: int
    layout: SampleLayout
    capacity: int


@dataclass
class Ready:
    """Batch of ``run`` in segment ``segment``: its first ``size`` rows hold the samples at the
    epoch ``positions`` (intervals)."""

    run: int
    segment: int
    size: int
    positions: list[list[int]]
    report: Report | None = None


@dataclass
class End:
    run: int
    report: Report | None = None


@dataclass
class Failed:
    """``error`` ends iteration ``run`` (at the batch it belongs to); ``run`` None: the child
    could not build its loader."""

    run: int | None
    error: BaseException
    report: Report | None = None


# ----- the parent's side -----


def pickled_arguments(arguments: dict[str, Any]) -> dict[str, bytes]:
    """Each argument pickled on its own, so that the one that cannot be is named."""
    payload = {}
    for name, value in arguments.items():
        try:
            payload[name] = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as error:
            shown = repr(value)
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            raise TypeError(
                f"isolate=True runs the pipeline in a process started with 'spawn', so {name}= must "
                f"pickle, and {shown} does not ({type(error).__name__}: {error}). Use a function or "
                f"class defined at the top level of a module, not a lambda, a nested function or a "
                f"local class"
            ) from error
    return payload


class ChildStats(LoaderStats):
    """``loader.stats`` with ``isolate=True``: the child's figures as of its last message, plus
    the parent's own device copies. ``as_dict()``, ``report()``, ``failures``, ``on_interval``
    work as in-process; the tuner's choices are in ``limits``."""

    def __init__(self, io_concurrency: int, num_threads: int, prefetch: int) -> None:
        super().__init__(io_concurrency, num_threads, prefetch)
        self._figures: dict[str, Any] | None = None

    def update(self, report: Report) -> None:
        figures = report.figures
        with self._lock:
            self._figures = figures
            self.failures.extend(report.failures)
            self.batches, self.samples = figures["batches"], figures["samples"]
            self.retries, self.consumer_wait_seconds = figures["retries"], figures["consumer_wait_seconds"]
            for name, stage in self.stages.items():
                if name != "copy":  # the parent's
                    stage.items, stage.seconds = figures[f"{name}/items"], figures[f"{name}/seconds"]
                    stage.bytes = figures[f"{name}/bytes"]
            self.limits = {key: figures[key] for key in self.limits}
        self._maybe_call_back()

    def as_dict(self) -> dict[str, Any]:
        if self._figures is None:
            return super().as_dict()
        with self._lock:
            figures = dict(self._figures)
            copy = self.stages["copy"]
            figures.update({"copy/items": copy.items, "copy/seconds": copy.seconds, "copy/bytes": copy.bytes})
        return figures


class IsolatedPipeline:
    """The parent's end: the child process, the pipe, and the segments mapped from the child."""

    def __init__(self, arguments: dict[str, Any], settings: Settings, stats: ChildStats) -> None:
        reason = shm.supported()
        if reason:
            raise RuntimeError(reason)
        from .isolate_child import child_main  # it imports this module's messages

        payload = pickled_arguments(arguments)
        context = multiprocessing.get_context("spawn")
        self.conn, child_end = context.Pipe(duplex=True)  # a socket pair: it carries descriptors
        self.process = context.Process(target=child_main, args=(child_end, payload), name="asyncload-isolated",
                                       daemon=True)
        self.process.start()
        child_end.close()  # the child's death must read as end-of-file here
        self.settings = settings
        self.stats = stats
        self.segments: dict[int, BatchBuffer] = {}
        self.pinned = torch.cuda.is_available()  # as the in-process ring pins its buffers
        self._with_user: set[int] = set()  # segments sent here and not yet reported released
        self._forgotten: set[int] = set()  # segments the child dropped, still mapped here
        self._runs = itertools.count(1)
        # Why the pipeline cannot go on. A fresh error is raised each time: one kept and raised
        # again would keep the frames of every raise alive, and the batches in them.
        self._broken: tuple[str, BaseException | None] | None = None
        self._closed = False
        self._send_lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _shut_down, self.process, self.conn, self._send_lock, self.segments,
                                           self.pinned)

    # ----- iterations -----

    def run(self, state: dict[str, Any]) -> "IsolatedRun":
        """Starts an iteration in the child at once (as in-process threads start at ``iter()``)."""
        self._check()
        run = next(self._runs)
        self._send(Run(run, state, self._sweep()))
        return IsolatedRun(self, run)

    def want(self, run: int) -> None:
        self._send(Want(run, self._sweep()))

    def stop(self, run: int) -> None:
        if not self._closed and self._broken is None:
            try:
                self._send(Stop(run, self._sweep()))
            except RuntimeError:
                pass  # the child is gone: nothing to stop

    def next_message(self, run: int) -> Ready | End | Failed:
        """The next message of iteration ``run``; a batch from an earlier one is released."""
        while True:
            message = self._receive()
            if isinstance(message, Failed) and message.run is None:
                self._broken = ("the isolated loader's process could not build its pipeline", message.error)
                self._check()
            if isinstance(message, Ready):
                self._with_user.add(message.segment)
                if message.run == run:
                    self.segments[message.segment].in_pipeline = True
                    return message
            elif message.run == run:
                return message

    # ----- segments -----

    def _sweep(self) -> list[int]:
        """Segments whose batches the user has let go of; unmaps those the child dropped."""
        released = [i for i in self._with_user if self.segments[i].is_free()]
        self._with_user.difference_update(released)
        for i in [i for i in self._forgotten if i not in self._with_user]:
            self._forgotten.discard(i)
            buffer = self.segments.pop(i)
            if self.pinned:
                shm.unpin(buffer)
        return released

    def _map(self, segment: Segment, fd: int) -> None:
        try:
            buffer = shm.buffer_on(fd, segment.layout, segment.capacity)
        finally:
            os.close(fd)
        if self.pinned:
            shm.pin(buffer)
        self.segments[segment.id] = buffer

    # ----- the pipe -----

    def _receive(self) -> Ready | End | Failed:
        """The next message about batches; maps announced segments on the way and takes in
        the child's report."""
        while True:
            message = self._recv()
            if isinstance(message, Segment):
                self._map(message, self._io(reduction.recv_handle, self.conn))
                continue
            if message.report is not None:
                self.stats.update(message.report)
                self._forgotten.update(message.report.forgotten)
            return message

    def _check(self) -> None:
        if self._broken is not None:
            text, cause = self._broken
            raise RuntimeError(text) from cause

    def _recv(self) -> Any:
        self._check()
        if self._closed:
            raise RuntimeError("this iteration has ended: the loader was closed")
        try:
            ready = multiprocessing.connection.wait([self.conn, self.process.sentinel])
        except (OSError, ValueError):  # closed from another thread meanwhile
            ready = []
        if self.conn in ready:
            return self._io(self.conn.recv)
        if self._closed:
            raise RuntimeError("this iteration has ended: the loader was closed")
        self._died()

    def _send(self, message: Any) -> None:
        self._check()
        with self._send_lock:
            self._io(self.conn.send, message)

    def _io(self, operation: Any, *args: Any) -> Any:
        """One read or write on the pipe. A pipe that breaks means the child died; one left
        half-read or half-written (Ctrl-C at the wrong moment) cannot be used again."""
        try:
            return operation(*args)
        except (EOFError, OSError):
            if self._closed:
                raise RuntimeError("this iteration has ended: the loader was closed") from None
            self._died()
        except BaseException:
            self._broken = ("a message to or from the isolated loader's process was interrupted half-way; "
                            "create a new AsyncLoader", None)
            raise

    def _died(self) -> NoReturn:
        self.process.join(timeout=1.0)
        code = self.process.exitcode
        if code is None:
            how = "closed its pipe"
        elif code < 0:
            name = signal.Signals(-code).name
            how = f"was killed by {name}" + (" (the kernel's out-of-memory killer sends it)" if name == "SIGKILL" else "")
        else:
            how = f"exited with code {code} (its error output, if any, is above; a script that creates the " \
                  f"loader at the top level must guard it with `if __name__ == '__main__':`, as spawn requires)"
        self._broken = (f"the isolated loader's process (pid {self.process.pid}) {how}; "
                        f"create a new AsyncLoader to go on", None)
        self._check()

    def close(self) -> None:
        """Stops the child (killing it if it does not stop within ``CLOSE_TIMEOUT_S``) and
        unmaps every segment the user does not hold. Idempotent."""
        self._closed = True
        self._finalizer()


def _shut_down(process: multiprocessing.process.BaseProcess, conn: Any, send_lock: threading.Lock,
               segments: dict[int, BatchBuffer], pinned: bool) -> None:
    """The child stops and is reaped; segments are unpinned and dropped (a batch the user still
    holds stays valid: its views keep the mapping, which goes when they do). Runs from
    ``close()`` (perhaps on another thread than the iteration's), garbage collection or
    interpreter exit, so it takes no reference to the loader."""
    if send_lock.acquire(timeout=CLOSE_TIMEOUT_S):
        try:
            conn.send(Close())
        except (OSError, ValueError):
            pass  # the child is gone already
        finally:
            send_lock.release()
    process.join(CLOSE_TIMEOUT_S)
    if process.exitcode is None:
        process.kill()
        process.join()
    conn.close()
    process.close()
    if pinned:
        for buffer in segments.values():
            shm.unpin(buffer)
    segments.clear()


class IsolatedRun:
    """One iteration, run by the child; iterate it on the user's thread. Yields
    ``(epoch positions, batch)`` as ``EpochRun`` does, so ``AsyncLoader`` treats both alike."""

    def __init__(self, pipeline: IsolatedPipeline, run: int) -> None:
        self.pipeline = pipeline
        self.run = run
        self.s = pipeline.settings
        self._stopped = False

    def __iter__(self) -> Iterator[tuple[list[int], Any]]:
        while True:
            if self._stopped:
                raise RuntimeError("this iteration has ended: the loader was closed or iterated anew")
            self.pipeline.want(self.run)
            message = self.pipeline.next_message(self.run)
            if isinstance(message, End):
                return
            if isinstance(message, Failed):
                raise message.error
            positions = [p for start, stop in message.positions for p in range(start, stop)]
            yield positions, self._hand_out(self.pipeline.segments[message.segment], message.size)

    def _hand_out(self, buffer: BatchBuffer, size: int) -> Any:
        """The user's view of a batch, as ``EpochRun._hand_out``: tensors in shared memory, or
        converted with ``normalize``, or copied to the GPU on the side stream."""
        stage = self.s.device_stage
        if stage is not None:
            started = time.perf_counter()
            pending = stage.start_copy(buffer, size)
            self.s.stats.add("copy", time.perf_counter() - started, sum(t[:size].nbytes for t in buffer.tensors))
            return buffer.layout.unflatten(stage.hand_over(pending))
        if self.s.normalize is not None:
            out = buffer.layout.unflatten(convert_batch([t[:size] for t in buffer.tensors], self.s.normalize))
            buffer.in_pipeline = False
            return out
        return buffer.batch(size)

    def stop(self) -> None:
        """Tells the child to stop the iteration. Safe to call more than once."""
        if not self._stopped:
            self._stopped = True
            self.pipeline.stop(self.run)
