"""The parent's side of the child processes: starting them, the pipes, their death, shutdown.

Children come from a fresh interpreter, never forked from this one (it has threads and maybe
CUDA): the fork server, else spawn (``start.py``). Each has one duplex pipe (a socket pair, so
it can carry descriptors). All reading of the pipes is done by the user's thread while it waits
for a batch; nothing runs in the background here.

Shutdown: ``close()``/garbage collection tell the children to stop, wait briefly, then kill
them with their process groups; a child ends itself and its group when its parent dies, however
(``lifetime.py``); if a child dies, the
parent raises a ``RuntimeError`` that says how, rather than wait. Segments need no cleanup in
any of these cases (they are memfds: the kernel frees them with their last mapping).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import signal
import threading
import time
import weakref
from multiprocessing import reduction
from typing import Any, NoReturn

import torch

from ..pipeline.jobs import split
from ..redact import shown
from ..settings import LoaderSettings, share
from . import shm
from .script import guard_advice, needs_main, refuse_while_bootstrapping, script_refusal
from .lifetime import end_group
from .merged import ProcessStats
from .protocol import (MAIN_GUARD_EXIT, Broken, Close, Done, Fill, Limits, Map, Poisoned, Probe, Probed, Ready, Stop,
                       Stopped, Unmap, pickled_arguments)
from .segments import SegmentRing
from .start import start_child

HELD_SHOWN = 16  # a dead child's samples named in the error, at most
CLOSE_TIMEOUT_S = 2.0  # close(): how long the children may take to stop before they are killed


class ProcessPool:
    """The children, their pipes and the segment ring they share with this process: the
    driver's pipelines (``pipeline/pipelines.py``'s ``Pipelines``), one per child."""

    def __init__(self, count: int, settings: LoaderSettings, stats: ProcessStats, keep: int) -> None:
        refuse_while_bootstrapping()
        reason = shm.supported()
        if reason:
            raise RuntimeError(reason)
        arguments = settings.for_children()  # the loader's value: each child takes its share of the totals
        payload = pickled_arguments(arguments)
        refusal = script_refusal(payload, arguments)  # before any child could run the script's top level
        if refusal is not None:
            raise RuntimeError(f"asyncload: processes={count} cannot start child processes: {refusal}")
        self.stats = stats
        self.conns: list[Any] = []
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self.send_locks = [threading.Lock() for _ in range(count)]
        device = settings.device
        self.ring = SegmentRing(keep, device, self._announce, self._forget)
        # The finalizer must not reach this object (the ring's callbacks do): only plain parts.
        self._finalizer = weakref.finalize(self, _shut_down, self.processes, self.conns, self.send_locks,
                                           self.ring.segments, device)
        main = needs_main(payload) is not None  # else the children never import the user's script
        for index in range(count):
            conn, process = start_child(index, count, payload, main)
            self.conns.append(conn)
            self.processes.append(process)
        self._stopping: dict[int, tuple[set[int], list[Any]]] = {}  # run -> (children yet to answer, buffers)
        # Why the children cannot go on. A fresh error is raised each time: one kept and raised
        # again would keep the frames of every raise alive, and the batches in them.
        self._broken: tuple[str, BaseException | None] | None = None
        self._closed = False
        self._runs = 0
        self._source, self._labelled = settings.source, settings.labelled  # to name what a dead child held
        self._held: list[dict[tuple[int, Any], Any]] = [{} for _ in range(count)]  # (run, fill) -> its indices
        self._ready = 0  # children that said they built their pipeline

    def ready(self) -> bool:
        """Whether every child has built its pipeline, without waiting; raises as ``receive``
        does if one could not (its error, or how it died)."""
        while self._ready < self.count:
            got = self._next(0.0)
            if got is None:
                return False
            self._handle(*got)
        return True

    @property
    def count(self) -> int:
        return len(self.conns)

    def new_run(self) -> int:
        self.check()
        self._runs += 1
        return self._runs

    def set_limits(self, num_threads: int | None, io_concurrency: int | None) -> None:
        """The tuner's totals, shared among the children."""
        count = self.count
        self.broadcast(Limits(None if num_threads is None else share(num_threads, count),
                              None if io_concurrency is None else share(io_concurrency, count)))

    # ----- sending -----

    def send(self, index: int, message: Any, fd: int | None = None) -> None:
        self.check()
        if isinstance(message, Fill):  # per batch, not per sample: what the child holds until it answers
            self._held[index][message.run, message.fill] = message.indices
        elif isinstance(message, Probe):
            self._held[index][message.run, None] = [message.index]
        with self.send_locks[index]:
            self._io(index, self.conns[index].send, message)
            if fd is not None:
                self._io(index, reduction.send_handle, self.conns[index], fd, self.processes[index].pid)

    def broadcast(self, message: Any) -> None:
        for index in range(len(self.conns)):
            self.send(index, message)

    def _announce(self, message: Map, fd: int) -> None:
        for index in range(len(self.conns)):
            self.send(index, message, fd)

    def _forget(self, segments: list[int]) -> None:
        if not self._closed and self._broken is None:
            self.broadcast(Unmap(segments))

    def stop_run(self, run: int, buffers: list[Any], timeout: float | None = None) -> bool:
        """Tells every child that ``run`` is over; ``buffers`` (segments it may still write)
        go back to the ring once every child has answered ``Stopped``. Waits for nothing: no
        thread of this process is involved."""
        if self._closed or self._broken is not None or run in self._stopping:
            return True
        self._stopping[run] = (set(range(len(self.conns))), buffers)
        try:
            self.broadcast(Stop(run))
        except RuntimeError:
            pass  # a child is gone: the next wait says so
        return True

    # ----- receiving -----

    def receive(self, run: int, block: bool = True) -> Any:
        """The next message about ``run``; older runs' messages are dealt with on the way.
        ``block=False``: None when no message has arrived yet."""
        while True:
            got = self._next(None if block else 0.0)
            if got is None:
                return None
            index, message = got
            if self._handle(index, message) and message.run == run:
                return message

    def _handle(self, index: int, message: Any) -> bool:
        """Takes what every message carries (figures, trace) and deals with those about the
        children rather than a run; True for a message about a run, for the caller."""
        if message.figures is not None:
            self.stats.update(index, message.figures)
        if message.trace is not None and self.stats.tracer is not None:
            self.stats.tracer.merge(*message.trace, process_name=f"asyncload-{index}")
        if isinstance(message, Broken):
            self._broken = (message.what, message.error)
            self.check()
        if isinstance(message, Ready):
            self._ready += 1
            return False
        if isinstance(message, (Done, Probed)):
            self._held[index].pop((message.run, getattr(message, "fill", None)), None)
        if isinstance(message, Poisoned):  # whatever the run: the segment is never free again
            if (poisoned := self.ring.segments.get(message.segment)) is not None:
                poisoned.poisoned = True
        elif isinstance(message, Stopped):
            self._stopped(index, message.run)
        else:
            return True
        return False

    def _stopped(self, index: int, run: int) -> None:
        for key in [key for key in self._held[index] if key[0] == run]:
            del self._held[index][key]
        if (waiting := self._stopping.get(run)) is None:
            return
        waiting[0].discard(index)
        if not waiting[0]:
            for buffer in waiting[1]:
                buffer.give_back()
            self._stopping.pop(run, None)  # close() on another thread may have cleared it

    def _next(self, timeout: float | None) -> tuple[int, Any] | None:
        self.check()
        if self._closed:
            raise RuntimeError("this iteration has ended: the loader was closed")
        sentinels = {process.sentinel: index for index, process in enumerate(self.processes)}
        try:
            ready = multiprocessing.connection.wait([*self.conns, *sentinels], timeout)
        except (OSError, ValueError):  # closed from another thread meanwhile
            ready = []
        for index, conn in enumerate(self.conns):
            if conn in ready:
                return index, self._io(index, conn.recv)
        if not ready and timeout is not None and not self._closed:
            return None
        if self._closed:
            raise RuntimeError("this iteration has ended: the loader was closed")
        for sentinel in ready:
            if sentinel in sentinels:
                self._died(sentinels[sentinel])
        raise RuntimeError("this iteration has ended: the loader was closed")

    # ----- failures -----

    def check(self) -> None:
        if self._broken is not None:
            text, cause = self._broken
            raise RuntimeError(text) from cause

    def _io(self, index: int, operation: Any, *args: Any) -> Any:
        """One read or write on a pipe. A pipe that breaks means the child died; one left
        half-read or half-written (Ctrl-C at the wrong moment) cannot be used again."""
        try:
            return operation(*args)
        except (EOFError, OSError):
            if self._closed:
                raise RuntimeError("this iteration has ended: the loader was closed") from None
            self._died(index)
        except BaseException:
            self._broken = ("a message to or from a loader process was interrupted half-way; "
                            "create a new AsyncLoader", None)
            raise

    def _died(self, index: int) -> NoReturn:
        process = self.processes[index]
        process.join(timeout=1.0)
        code = process.exitcode
        if code == MAIN_GUARD_EXIT:
            self._broken = (guard_advice(), None)
            self.check()
        if code is None:
            how = "closed its pipe"
        elif code < 0:
            name = signal.Signals(-code).name
            how = f"was killed by {name}" + (" (the kernel's out-of-memory killer sends it)" if name == "SIGKILL" else "")
        else:
            how = f"exited with code {code} (its error output, if any, is above)"
        self._broken = (f"a loader process (pid {process.pid}) {how}{self._held_items(index)}; "
                        f"create a new AsyncLoader to go on", None)
        self.check()

    def _held_items(self, index: int) -> str:
        """``" while it held samples ..."``: the items child ``index`` was given and had not
        answered for, where the cause (a decoder that crashes on one file) usually is."""
        indices = sorted({int(i) for held in self._held[index].values() for i in held})
        if not indices:
            return ""
        items = []
        for i in indices[:HELD_SHOWN]:
            try:
                items.append(shown(split(self._source, self._labelled, i)[0]))
            except Exception:
                items.append(f"source[{i}]")
        more = f" and {len(indices) - HELD_SHOWN} more" if len(indices) > HELD_SHOWN else ""
        return f" while it held these samples: {', '.join(items)}{more}"

    def close(self) -> None:
        """Stops the children (killing those that do not stop within ``CLOSE_TIMEOUT_S``) and
        unpins every segment. Idempotent; safe from another thread during a wait."""
        self._closed = True
        self._finalizer()
        self._stopping.clear()


def _shut_down(processes: list[Any], conns: list[Any], send_locks: list[threading.Lock],
               segments: dict[int, Any], device: torch.device | None) -> None:
    """Runs from ``close()`` (perhaps on another thread than the iteration's), garbage
    collection or interpreter exit, so it takes no reference to the pool."""
    for conn, lock in zip(conns, send_locks):
        if lock.acquire(timeout=CLOSE_TIMEOUT_S):
            try:
                conn.send(Close())
            except (OSError, ValueError):
                pass  # the child is gone already
            finally:
                lock.release()
    deadline = time.monotonic() + CLOSE_TIMEOUT_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.exitcode is None:  # not waited for yet: its pid is still its own
            end_group(process.pid)  # with what it started (a child leads its process group)
            process.join()
    for conn in conns:
        conn.close()
    for process in processes:
        process.close()
    if device is not None:  # a batch the user still holds stays valid: its views keep the mapping
        for buffer in segments.values():
            shm.unpin(buffer, device)
    segments.clear()
