"""A child process of ``processes=N``: maps the parent's shared segments and runs the pipeline
(``pipeline/pipeline.py``, the same code as in-process) on them.

The child builds no ``AsyncLoader``: the parent's driver owns the epoch (order, cursor, failure
budget, resume state) and sends the pipeline's messages (``protocol.py``). Three kinds of
thread: the main thread reads the parent's messages; the pipeline's event loop and decode
threads do the work and send the answers; and a lifeline thread that does nothing but end the
process, and what it started, when the parent is gone (``lifetime.py``).

A thread of the child that dies of an exception nobody expected (a bug, or an answer that
cannot be pickled) would leave the parent waiting for an answer that never comes: it is sent
to the parent as ``Broken`` instead, and the parent raises it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
from multiprocessing import forkserver, reduction
from typing import Any

from ..batch.buffers import BatchBuffer
from ..pipeline.pipeline import Pipeline
from ..settings import LoaderSettings, share
from ..stats.loader_stats import LoaderStats
from ..stats.trace import Tracer
from . import shm
from .lifetime import end_group, end_others_in_group, lead_group
from .protocol import Broken, Close, Done, Failed, Limits, Map, Probed, Ready, Start, Stop, Unmap, portable, unpickle

CLOSE_WAIT_S = 1.5  # Close: how long the pipeline's threads may take to end (the parent kills at 2 s)

CHILD_NICENESS = 10  # at least: the child yields the CPU to the training process (see _lower_priority)


def child_main(conn: Any, payload: dict[str, bytes], count: int, environ: dict[str, str]) -> None:
    """The child process: builds its pipeline from the loader's settings (``payload``, pickled
    field by field) with its share of the threads and reads among ``count`` children, then
    serves the parent until it closes or dies. ``environ``: the parent's environment when it
    started this child (a fork server's own is the one it started with: ``start.py``)."""
    lead_group()  # first: what this process starts is in its group, and ends with it
    _leave_fork_server()
    threading.Thread(target=_exit_with_parent, name="asyncload-lifeline", daemon=True).start()
    os.environ.clear()
    os.environ.update(environ)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent handles it
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # no CUDA context here: the parent pins and copies
    _lower_priority()
    child = _Child(conn)
    threading.excepthook = child.thread_died
    try:
        settings = LoaderSettings(**{name: unpickle(name, data) for name, data in payload.items()})
        child.stats.limits.update(io_concurrency=share(settings.io_concurrency, count),
                                  num_threads=share(settings.threads_started, count))
        if settings.trace is not None:  # the parent traces: this child records its events, sent with its answers
            child.stats.tracer = Tracer(None, settings.trace_events, multiprocessing.current_process().name)
        child.pipeline = Pipeline(settings, child.segments.__getitem__, child.send, child.stats, processes=count)
    except BaseException as error:
        child.send(Broken(portable(error)))
        _wait_for_close(conn)  # exiting now could break the pipe before the parent reads why
        _exit(1)
    child.send(Ready())
    child.serve()


def _leave_fork_server() -> None:
    """Closes this process's copy of the fork server's "alive" pipe, which the fork server
    hands every child it forks: the fork server's backstop (``server.py``) waits for that pipe's
    end-of-file, which never comes while a child holds it, so a child whose decode holds the GIL
    (its lifeline thread cannot run) would outlive a parent killed by SIGKILL. Forgetting the
    address too makes this process's own use of the forkserver method (a decode's Pool) start a
    fork server of its own, as CPython does when none was inherited."""
    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if server is None or fd is None:
        return  # spawned, or a CPython without these attributes: the lifeline thread remains
    with contextlib.suppress(OSError):
        os.close(fd)
    server._forkserver_alive_fd = None
    server._forkserver_address = None
    server._forkserver_pid = None


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
    pools started by imports) are lowered one by one; later ones inherit it. A parent that runs
    at niceness 10 or more already has children at its own level (they start with its niceness):
    they never go below the parent's priority relative to the rest of the machine."""
    try:
        niceness = os.nice(max(0, CHILD_NICENESS - os.nice(0)))
        for thread in os.listdir("/proc/self/task"):
            os.setpriority(os.PRIO_PROCESS, int(thread), niceness)
    except OSError:
        pass


def _exit_with_parent() -> None:
    """Ends this process's group (this process and whatever it started) as soon as the parent
    process is gone, whatever the other threads are doing: the control thread may be waiting
    for a stuck decode, and a decode may have started processes of its own."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    multiprocessing.connection.wait([parent.sentinel])  # ready once the parent has exited
    end_group(os.getpid())  # this process included


def _exit(code: int) -> None:
    """Leaves without the interpreter's teardown (a second or more with torch loaded), and
    without leaving behind what this process started."""
    end_others_in_group()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


class _Child:
    """The control thread's state: the pipe, the stats, the segments, the pipeline."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.stats = LoaderStats()
        self.segments: dict[int, BatchBuffer] = {}
        self.pipeline: Pipeline | None = None
        self.send_lock = threading.Lock()
        self.started: set[int] = set()  # runs whose active time the stats count

    def serve(self) -> None:
        """Handles the parent's messages until it closes the loader or dies."""
        pipeline = self.pipeline
        assert pipeline is not None
        while True:
            try:
                message = self.conn.recv()
                if isinstance(message, Map):
                    fd = reduction.recv_handle(self.conn)
                    try:
                        buffer = shm.buffer_on(fd, message.layout, message.capacity)
                        buffer.slot = message.segment  # the name a Poisoned answer gives it back by
                        buffer.crosses = True  # what its rows put aside travels to the parent
                        self.segments[message.segment] = buffer
                    finally:
                        os.close(fd)
            except (EOFError, OSError):
                _exit(0)  # the parent died: nobody is left to clean up for
            if isinstance(message, Unmap):
                for segment in message.segments:
                    self.segments.pop(segment, None)  # a write still running keeps its views
            elif isinstance(message, Limits):
                pipeline.set_limits(message.num_threads, message.io_concurrency)
            elif isinstance(message, Close):
                try:
                    pipeline.close(time.monotonic() + CLOSE_WAIT_S)
                finally:
                    self.conn.close()
                    _exit(0)
            elif not isinstance(message, Map):
                self._count_active(message)
                pipeline.handle(message)

    def _count_active(self, message: Any) -> None:
        """The stats' active time runs from a run's start to its stop."""
        if isinstance(message, Start):
            self.started.add(message.run)
            self.stats.run_started()
        elif isinstance(message, Stop) and message.run in self.started:
            self.started.discard(message.run)
            self.stats.run_stopped()

    def thread_died(self, args: threading.ExceptHookArgs) -> None:
        """``threading.excepthook``: a thread of this process ended with an exception nothing
        caught. One of the pipeline's (a decode thread that a ``BaseException`` from user code
        went through, say) leaves its work (a fill, a run) never answered: the parent is told,
        and raises it, rather than wait for ever. A thread the user's code started is the
        user's: its traceback is printed, as anywhere."""
        threading.__excepthook__(args)  # its traceback on stderr, as before
        name = args.thread.name if args.thread is not None else ""
        if args.exc_value is None or isinstance(args.exc_value, SystemExit) or not name.startswith("asyncload"):
            return
        error = RuntimeError(f"thread {name} of a loader process (pid {os.getpid()}) died: "
                             f"{type(args.exc_value).__name__}: {args.exc_value}")
        self.send(Broken(portable(error), what="a loader process cannot go on"))

    def send(self, message: Any) -> None:
        """Sends ``message`` with the current stats (any thread); errors go as they can cross.
        A broken pipe means the parent is gone: the lifeline thread ends the process. A message
        that does not pickle (a bug: samples never travel, and what goes aside was checked when
        it was written) goes as ``Broken``, so the parent raises instead of waiting for it."""
        if isinstance(message, Done) and message.failures:
            message.failures = [(row, portable(error)) for row, error in message.failures]  # type: ignore[misc]
        elif isinstance(message, Failed):
            message.error = portable(message.error)
        elif isinstance(message, Probed) and message.error is not None:
            message.error = portable(message.error)  # type: ignore[assignment]
        message.figures = self.stats.as_dict()
        if self.stats.tracer is not None:
            message.trace = self.stats.tracer.drain()
        try:
            data = reduction.ForkingPickler.dumps(message)
        except Exception as error:
            data = reduction.ForkingPickler.dumps(Broken(RuntimeError(
                f"a loader process (pid {os.getpid()}) could not send its {type(message).__name__} answer: "
                f"{type(error).__name__}: {error}"), what="a loader process cannot go on"))
        try:
            with self.send_lock:
                self.conn.send_bytes(data)
        except (OSError, ValueError):
            pass
