"""A timeline of a run, as Chrome trace-event JSON (opens in Perfetto and chrome://tracing).

The stats say which stage is slow on average; a timeline shows when and where: each sample's
read and decode on the thread (and process) that ran it, each batch's hand-out, the training
loop's wait for each batch, the reads in flight as a counter, failures as instant events.

Events go into a ring of the last ``max_events`` (a long run keeps its end, memory stays
bounded) under a lock (decode threads, the event loop and the user's thread all record). An
event is a small tuple; the JSON is built only when the file is written. Times are
``time.perf_counter()``, the system's monotonic clock on Linux, so events of child processes
line up with the parent's. Off (no ``trace=``), nothing is recorded: callers hold ``None``.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
import weakref
from collections import deque
from pathlib import Path
from typing import Any, Iterable

from ..redact import bounded, shown

# One event: (phase, name, start s, duration s, pid, tid, args). Phases as Chrome's:
# "X" a span, "i" an instant, "C" a counter, "b"/"e" the ends of an async span (reads that
# overlap on the event loop's one thread, drawn on tracks of their own).
Event = tuple[str, str, float, float, int, int, Any]

DEFAULT_EVENTS = 200_000  # about 40 MB of tuples at most; a few seconds of a fast run's samples


class Tracer:
    """Records events of this process; the parent's also holds the children's (``merge``) and
    writes them all to ``path`` at ``finish`` (a child's ``path`` is None: it drains to the parent)."""

    def __init__(self, path: str | os.PathLike | None, max_events: int = DEFAULT_EVENTS,
                 process_name: str = "training process") -> None:
        if max_events < 1:
            raise ValueError(f"trace_events must be at least 1, got {max_events}")
        self.events: deque[Event] = deque(maxlen=max_events)
        self.pid = os.getpid()
        self.names: dict[tuple[int, int], str] = {}  # (pid, tid) -> thread name
        self.processes: dict[int, str] = {self.pid: process_name}
        self._local = threading.local()  # this thread's native id, once known
        self._ids = itertools.count()
        self._lock = threading.Lock()
        # Written once: at finish() (the loader's close), or when the tracer is collected or the
        # program exits, for a loader never closed. The finalizer holds the parts, not the tracer.
        self._finish = weakref.finalize(self, _write, path, self.events, self.names, self.processes, self._lock)

    def _tid(self) -> int:
        tid = getattr(self._local, "tid", None)
        if tid is None:
            tid = self._local.tid = threading.get_native_id()
            with self._lock:
                self.names[(self.pid, tid)] = threading.current_thread().name
        return tid

    def span(self, name: str, start: float, end: float, args: Any = None) -> None:
        """Stage ``name`` ran on this thread from ``start`` to ``end`` (``perf_counter`` s)."""
        event = ("X", name, start, end - start, self.pid, self._tid(), args)
        with self._lock:
            self.events.append(event)

    def async_span(self, name: str, start: float, end: float, args: Any = None) -> None:
        """Like ``span``, for work that overlaps on one thread (reads awaited on the event loop)."""
        tid, number = self._tid(), next(self._ids)
        with self._lock:
            self.events.append(("b", name, start, 0.0, self.pid, tid, (number, args)))
            self.events.append(("e", name, end, 0.0, self.pid, tid, (number, None)))

    def instant(self, name: str, args: Any = None) -> None:
        event = ("i", name, time.perf_counter(), 0.0, self.pid, self._tid(), args)
        with self._lock:
            self.events.append(event)

    def counter(self, name: str, value: int) -> None:
        event = ("C", name, time.perf_counter(), 0.0, self.pid, self._tid(), value)
        with self._lock:
            self.events.append(event)

    # ----- across processes -----

    def drain(self) -> tuple[list[Event], dict[tuple[int, int], str]]:
        """A child's events since the last drain, and its thread names (sent to the parent)."""
        with self._lock:
            events = list(self.events)
            self.events.clear()
            return events, dict(self.names)

    def merge(self, events: Iterable[Event], names: dict[tuple[int, int], str], process_name: str) -> None:
        """Takes in a child's drained events (the ring keeps the newest)."""
        with self._lock:
            self.events.extend(events)
            self.names.update(names)
            for pid, _ in names:
                self.processes.setdefault(pid, process_name)

    # ----- the file -----

    def finish(self) -> None:
        """Writes the file (once; later calls do nothing). Building the JSON costs about 4.5 µs an
        event (0.45 s for 100,000 on the 2-core bench VM), more than recording them: the loader
        writes once, when it is closed."""
        self._finish()


def _write(path: str | os.PathLike | None, events: deque[Event], names: dict[tuple[int, int], str],
           processes: dict[int, str], lock: threading.Lock) -> None:
    """Writes the events to ``path`` as Chrome trace-event JSON (``{"traceEvents": [...]}``),
    replacing the file whole (written beside it, then renamed: a reader never sees half a file)."""
    if path is None:
        return
    with lock:
        events, names, processes = list(events), dict(names), dict(processes)  # type: ignore[assignment]
    out: list[dict[str, Any]] = []
    for pid, name in processes.items():
        out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}})
    for (pid, tid), name in names.items():
        out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
    out.extend(_as_json(event) for event in events)
    target = Path(path)
    partial = target.with_name(target.name + ".partial")
    partial.write_text(json.dumps({"traceEvents": out, "displayTimeUnit": "ms"}))
    os.replace(partial, target)


def _as_json(event: Event) -> dict[str, Any]:
    phase, name, start, duration, pid, tid, args = event
    entry: dict[str, Any] = {"ph": phase, "name": name, "ts": round(start * 1e6, 3), "pid": pid, "tid": tid,
                             "cat": "asyncload"}
    if phase == "X":
        entry["dur"] = round(duration * 1e6, 3)
        if args is not None:
            entry["args"] = {"sample": _plain(args)}
    elif phase in ("b", "e"):
        number, detail = args
        entry["id"] = number
        if detail is not None:
            entry["args"] = {"sample": _plain(detail)}
    elif phase == "C":
        entry["args"] = {name: args}
    elif phase == "i":
        entry["s"] = "t"  # drawn on its thread
        if args is not None:
            entry["args"] = {key: _plain(value) for key, value in args.items()}
    return entry


def _plain(value: Any) -> Any:
    """A JSON value for a sample key or a detail: numbers stay, text is redacted and bounded (a
    presigned URL's signature or a 1 MB key is not written out), the rest as its repr, alike."""
    if isinstance(value, (int, float, bool)) or value is None:
        return value
    return bounded(value) if isinstance(value, str) else shown(value)
