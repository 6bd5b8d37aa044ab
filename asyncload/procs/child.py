"""The child's side of ``isolate=True`` (see ``isolate.py``): builds an ordinary ``AsyncLoader``
whose ring allocates shared-memory segments, and forwards its batches to the parent.

Three kinds of thread: the main thread reads the parent's messages (start, want, release, stop,
close); a forwarder per iteration pulls batches from the loader, at most one ahead of what the
user asked for, and sends where they are; and a lifeline thread that does nothing but exit the
process when the parent is gone.
"""

from __future__ import annotations

import itertools
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import threading
import traceback
import weakref
from collections import deque
from multiprocessing import reduction
from typing import Any, Iterator

import torch

from . import shm
from .buffers import BatchBuffer, SampleLayout
from .errors import SampleError, TooManyFailures
from .isolate import Close, End, Failed, Ready, Report, Run, Segment, Stop, Want
from .stats import LoaderStats

CHILD_NICENESS = 10  # the child yields the CPU to the training process (see _lower_priority)
RING_SLACK = 4  # buffers beyond prefetch: the one the user holds, its predecessor not yet
# reported released, one sent ahead, one spare; fewer would make the child allocate anew


def child_main(conn: Any, payload: dict[str, bytes]) -> None:
    """The child process: builds the loader, then serves the parent until it closes or dies."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent handles it
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # no CUDA context here: the parent pins and copies
    _lower_priority()
    threading.Thread(target=_exit_with_parent, name="asyncload-isolate-lifeline", daemon=True).start()
    child = _Child(conn)
    try:
        child.build(payload)
    except BaseException as error:
        child.send(Failed(None, portable(error)))
        _wait_for_close(conn)  # exiting now could break the pipe before the parent reads why
        _exit(1)
    child.serve()


def _wait_for_close(conn: Any) -> None:
    while True:
        try:
            if isinstance(conn.recv(), Close):
                return
        except (EOFError, OSError):
            return


def _lower_priority() -> None:
    """A process of its own takes the GIL out of the training process's way, not the CPU: its
    decode threads still compete for cores with the training step. At a lower priority they
    get the cores the training process leaves idle, and the step runs about as fast as alone
    (the README's measurement). The cost: a training process that keeps every core busy
    starves the loader. Linux keeps a niceness per thread: threads that exist already (thread
    pools started by imports) are lowered one by one; later ones inherit it."""
    try:
        niceness = os.nice(CHILD_NICENESS)
        for thread in os.listdir("/proc/self/task"):
            os.setpriority(os.PRIO_PROCESS, int(thread), niceness)
    except OSError:
        pass


def _exit_with_parent() -> None:
    """Exits as soon as the parent process is gone, whatever the other threads are doing: the
    control thread that reads the pipe may be waiting for a stuck decode to finish."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    multiprocessing.connection.wait([parent.sentinel])  # ready once the parent has exited
    _exit(0)


def _exit(code: int) -> None:
    """Leaves without the interpreter's teardown (a second or more with torch loaded)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


class _Child:
    """The child's state: its loader, the views of batches the parent holds, the segments."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.loader: Any = None
        self.lock = threading.RLock()  # held, by_address, forgotten; re-entered by a finalizer
        self.send_lock = threading.Lock()
        self.credit = threading.Condition()
        self.held: dict[int, Any] = {}  # segment -> the batch views the parent holds
        self.by_address: dict[int, int] = {}  # segment start -> segment id
        self.forgotten: list[int] = []
        self.new_segments: deque[tuple[Segment, int]] = deque()
        self.ids = itertools.count()
        self.failures_sent = 0
        self.forwarder: _Forwarder | None = None

    def build(self, payload: dict[str, bytes]) -> None:
        from .loader import AsyncLoader

        arguments = {name: _unpickle(name, data) for name, data in payload.items()}
        self.loader = AsyncLoader(**arguments)
        ring = self.loader._settings.ring
        ring.allocate = self.allocate
        ring.keep = arguments["prefetch"] + RING_SLACK

    def allocate(self, layout: SampleLayout, capacity: int) -> BatchBuffer:
        """The ring's allocator (on the event loop thread): a new segment, announced to the
        parent with the next message."""
        segment = next(self.ids)
        _, size = shm.field_offsets(layout, capacity)
        fd = shm.create(f"asyncload-{os.getpid()}-{segment}", size)
        try:
            buffer = shm.buffer_on(fd, layout, capacity)
        except BaseException:
            os.close(fd)
            raise
        start = shm.address(buffer)
        with self.lock:
            self.by_address[start] = segment
        weakref.finalize(buffer, self._forget, segment, start)
        self.new_segments.append((Segment(segment, layout, capacity), fd))
        return buffer

    def _forget(self, segment: int, start: int) -> None:
        """The ring dropped a buffer (any thread): the segment will not be used again."""
        with self.lock:
            if self.by_address.get(start) == segment:
                del self.by_address[start]
            self.forgotten.append(segment)

    # ----- the control thread (the main thread) -----

    def serve(self) -> None:
        """Handles the parent's messages until it closes the loader or dies."""
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                _exit(0)  # the parent died: nobody is left to clean up for
            if isinstance(message, Want):
                self.release(message.released)
                with self.credit:
                    if self.forwarder is not None and self.forwarder.run_id == message.run:
                        self.forwarder.wanted += 1
                        self.credit.notify_all()
            elif isinstance(message, Run):
                self.stop_forwarder()
                self.release(message.released)
                self.start(message)
            elif isinstance(message, Stop):
                self.release(message.released)
                if self.forwarder is not None and self.forwarder.run_id == message.run:
                    self.stop_forwarder()
            elif isinstance(message, Close):
                self.stop_forwarder()
                self.loader.close()
                self.conn.close()
                _exit(0)

    def start(self, message: Run) -> None:
        try:
            self.loader.load_state_dict(message.state)
            batches = iter(self.loader)
        except Exception as error:
            self.send(Failed(message.run, portable(error)))
            return
        self.forwarder = _Forwarder(self, message.run, batches, message.state["delivered"])
        self.forwarder.start()

    def stop_forwarder(self) -> None:
        forwarder = self.forwarder
        if forwarder is None:
            return
        with self.credit:
            forwarder.stopped = True
            self.credit.notify_all()
        self.loader._stop_run()  # ends a wait for the pipeline; nothing if the run is over
        forwarder.join()
        self.forwarder = None

    def release(self, segments: list[int]) -> None:
        with self.lock:
            views = [self.held.pop(segment, None) for segment in segments]
        del views  # outside the lock: the last view of a dropped buffer unmaps it

    # ----- sending (forwarder thread, or control thread for a failed start) -----

    def send(self, message: Ready | End | Failed) -> None:
        """Announces new segments first, then sends ``message`` with a fresh report."""
        with self.send_lock:
            while self.new_segments:
                segment, fd = self.new_segments.popleft()
                self.conn.send(segment)
                reduction.send_handle(self.conn, fd, os.getppid())
                os.close(fd)
            message.report = self.report()
            self.conn.send(message)

    def report(self) -> Report:
        stats = self.loader.stats if self.loader is not None else LoaderStats()
        failures = stats.failures[self.failures_sent :]
        self.failures_sent += len(failures)
        with self.lock:
            forgotten, self.forgotten = self.forgotten, []
        return Report(stats.as_dict(), failures, forgotten)

    def hold(self, batch: Any) -> tuple[int, int]:
        """Keeps the views of a batch sent to the parent; returns its segment and rows."""
        leaf = batch
        while not isinstance(leaf, torch.Tensor):
            leaf = next(iter(leaf.values())) if isinstance(leaf, dict) else leaf[0]
        with self.lock:
            segment = self.by_address[leaf.untyped_storage().data_ptr()]
            self.held[segment] = batch
        return segment, leaf.shape[0]


class _Forwarder(threading.Thread):
    """Iterates the child's loader and sends each batch, at most one ahead of what the user
    asked for, so the child's pipeline stays ``prefetch`` batches ahead as in-process."""

    def __init__(self, child: _Child, run: int, batches: Iterator[Any], delivered: list[list[int]]) -> None:
        super().__init__(name="asyncload-isolate-forward", daemon=True)
        self.child = child
        self.run_id = run
        self.batches = batches
        self.delivered = [list(i) for i in delivered]
        self.wanted = 0  # batches the user asked for; guarded by child.credit
        self.stopped = False

    def _wait_for_credit(self, sent: int) -> bool:
        with self.child.credit:
            while not self.stopped and sent > self.wanted:
                self.child.credit.wait()
            return not self.stopped

    def _forward(self) -> None:
        sent = 0
        while self._wait_for_credit(sent):
            try:
                batch = next(self.batches)
            except StopIteration:
                self.child.send(End(self.run_id))
                return
            except Exception as error:
                if not self.stopped:
                    self.child.send(Failed(self.run_id, portable(error)))
                return
            delivered = self.child.loader.state_dict()["delivered"]
            positions = new_positions(self.delivered, delivered)
            self.delivered = delivered
            segment, size = self.child.hold(batch)
            del batch  # the child's only reference is in `held` now
            self.child.send(Ready(self.run_id, segment, size, positions))
            sent += 1

    def run(self) -> None:
        try:
            self._forward()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the parent is gone; the control thread exits
        finally:
            self.batches.close()  # type: ignore[attr-defined]  # stops the run, if still going



def new_positions(before: list[list[int]], after: list[list[int]]) -> list[list[int]]:
    """The intervals of ``after`` that are not in ``before`` (which ``after`` contains): one
    batch's epoch positions, from the delivered positions before and after it."""
    out = []
    for start, stop in after:
        cursor = start
        for low, high in before:
            if high <= cursor or low >= stop:
                continue
            if low > cursor:
                out.append([cursor, low])
            cursor = max(cursor, high)
        if cursor < stop:
            out.append([cursor, stop])
    return out


def portable(error: BaseException) -> BaseException:
    """``error`` as it can cross the pipe: itself if it pickles, else stand-ins with its text.
    The child's traceback goes along as a note on the underlying error."""
    cause = error.cause if isinstance(error, SampleError) and not isinstance(error, TooManyFailures) else error
    if hasattr(cause, "add_note") and cause.__traceback__ is not None:
        text = "".join(traceback.format_exception(type(cause), cause, cause.__traceback__))
        cause.add_note("in the isolated loader's process:\n" + text.rstrip())
    try:
        return pickle.loads(pickle.dumps(error))
    except Exception:
        pass
    if isinstance(error, TooManyFailures):
        return TooManyFailures([portable(f) for f in error.failures], error.max_failures)  # type: ignore[misc]
    if isinstance(error, SampleError):
        return SampleError(error.item, error.stage, _stand_in(error.cause))
    return _stand_in(error)


def _stand_in(error: BaseException) -> RuntimeError:
    stand_in = RuntimeError(f"{type(error).__name__}: {error}")
    for note in getattr(error, "__notes__", []):
        stand_in.add_note(note)
    return stand_in


def _unpickle(name: str, data: bytes) -> Any:
    try:
        return pickle.loads(data)
    except Exception as error:
        raise RuntimeError(
            f"the isolated loader's process could not unpickle {name}= ({type(error).__name__}: {error}); "
            f"a spawned process finds functions and classes by module and name, so those defined in an "
            f"interactive session's __main__ are not found: define them in a module"
        ) from error
