"""Filling batch rows on the decode threads: read (local files), decode, write, report.

Python per sample is what one GIL runs out of first, so the work is handed out by chunks of a
batch's rows: one job reads each local file with three system calls (no Python file object, the
size known from ``fstat``), decodes it straight into its row, and at the end of the chunk adds
its figures to the stats once and reports its rows done once. Only failures go back to the event
loop, one by one (they may take a replacement from the epoch's cursor, which the loop owns).
Also the item -> (what to read, label) rule every row starts from (``split``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from ..batch.buffers import BatchBuffer
from ..batch.layout import Field
from ..cache.items import KeptRead
from ..errors import SampleError
from ..io.limits import read_file
from ..sources.items import is_labelled
from ..sources.mix import MixedSource
from ..sources.shards import ShardSource
from ..stats.loader_stats import LoaderStats
from .watchdog import Slot
from .workers import current_slot


@dataclass
class Work:
    """One fill being worked on in a pipeline: the rows the driver asked for of one batch buffer.
    Every row ends exactly once, done or failed (``failures``); the last one sends the fill's
    answer. ``cancelled``: its run was stopped, so jobs that have not started end their rows
    without reading or decoding."""

    fill_id: int  # the fill's id, unique within its run
    buffer: BatchBuffer
    remaining: int
    run: Any = None  # the pipeline's state of the run the fill belongs to
    failures: list[tuple[int, SampleError]] = field(default_factory=list)
    cancelled: bool = False
    rows: Sequence[int] = ()  # the buffer's rows it fills: what they put aside goes with its answer


@dataclass
class Row:
    """What one row needs: its number in the batch, the item's key and label, its source index
    (with the epoch, the key of the decoder's random choices), and its bytes if already read."""

    row: int
    key: Any
    label: int | tuple[int, ...] | None  # a tuple in a mix: (label, source number) or (source number,)
    index: int
    data: Any = None


def local_path(key: Any) -> str | None:
    """The file system path of a plain path or ``file://`` URL, else None (without fsspec: this
    runs for every sample)."""
    if not isinstance(key, str):
        return None
    if "://" not in key and "::" not in key:
        return key
    if key.startswith("file://") and "::" not in key:
        return key[len("file://"):]
    return None


def read_plain_file(key: Any, limit: int | None = None) -> bytes | None:
    """The bytes of a plain path or ``file://`` URL naming a regular file; None for anything else
    (another protocol, a FIFO): the caller reads those through the reader, with its timeout."""
    path = local_path(key)
    return read_file(path, limit, regular_only=True) if path is not None else None


def read_on_decode_thread(key: Any, read_other: Callable[[str], bytes], limit: int | None = None) -> bytes:
    """A local row's bytes, for a decode thread: a plain regular file read here (``read_plain_file``,
    at most ``limit`` bytes), any other local URL through ``read_other`` (the reader's
    ``read_local``: on a read thread, with its timeout and limit)."""
    data = read_plain_file(key, limit)
    return read_other(key) if data is None else data


def decodes_in_place(decode: Any) -> bool:
    """Whether ``decode`` declares its output (``field``) and writes it into a row itself."""
    return isinstance(getattr(decode, "field", None), Field) and hasattr(decode, "decode_into")


class RowFiller:
    """Decodes samples into their rows on a decode thread and reports each chunk of rows once.

    ``read_other`` reads a local URL that is not a plain path or regular file (``memory://``, a
    FIFO) with the reader's timeout; ``rows_done`` is
    called with a batch and how many of its rows are complete; ``row_failed`` with a batch, a row
    and its ``SampleError`` (the row is then not done: the failure policy completes it);
    ``poisoned`` with a batch whose in-place decode was abandoned (``watchdog.py``), before its
    row fails."""

    def __init__(self, decode: Callable[[Any], Any], epoch: int, stats: LoaderStats,
                 read_other: Callable[[str], bytes], rows_done: Callable[[Work, int], None],
                 row_failed: Callable[[Work, int, SampleError], None], max_bytes: int | None = None,
                 poisoned: Callable[[Work], None] = lambda work: None) -> None:
        self.decode = decode
        self.in_place = decodes_in_place(decode)
        self.epoch = epoch
        self.stats = stats
        self.read_other = read_other
        self.max_bytes = max_bytes  # max_sample_bytes, for the files read here
        self.rows_done = rows_done
        self.row_failed = row_failed
        self.poisoned = poisoned

    def fill(self, batch: Work, rows: Sequence[Row]) -> None:
        """A decode job: reads the rows whose ``data`` is None (local files), decodes every row into
        ``batch``'s buffer, then reports. A job of a stopped run ends its rows unread. Each
        read's and decode's start goes in the thread's slot (``watchdog.py``), so the watchdog can
        abandon one that never returns (a local file on a hung mount: that row fails at stage
        ``read``, after ``decode_timeout``: a plain file is read here, with no read thread); then this job ends at once and writes nothing more (a ``decode_into``
        running may still write its row: the buffer is poisoned, see ``watchdog.py``)."""
        if batch.cancelled:
            self.rows_done(batch, len(rows))
            return
        buffer, stats, trace = batch.buffer, self.stats, self.stats.tracer
        slot = current_slot()
        slot.on_timeout, slot.work, slot.rows = self._timed_out, batch, rows
        slot.writes = buffer if self.in_place else None
        stats.level("decodes_running", 1)
        read_s = decode_s = cpu = 0.0
        nbytes = reads = done = 0
        now = time.perf_counter()
        for index, row in enumerate(rows):
            data = row.data
            if data is None or isinstance(data, KeptRead):  # timed as the decode is: a hard network mount may never answer
                slot.index, slot.done, slot.reading, slot.started = index, done, True, now
                try:
                    if data is None:
                        data = read_on_decode_thread(row.key, self.read_other, self.max_bytes)
                    else:  # a cache's kept copy (not a read from storage: not counted as one)
                        data = data.read()
                except Exception as error:
                    if not slot.claim():
                        return  # abandoned while it read: the watchdog reported this job's rows
                    self.row_failed(batch, row.row, SampleError(row.key, "read", error))
                    continue
                finally:
                    started, now = now, time.perf_counter()
                    read_s += now - started
                    if trace is not None:
                        trace.span("read", started, now, row.key)
                if row.data is None:
                    reads += 1
                    nbytes += len(data)
            slot.index, slot.done, slot.reading, slot.started = index, done, False, now  # started last: read first
            cpu_started = time.thread_time()  # CPU inside decode alone: the GIL verdict reads it
            try:
                if not self._decode_row(buffer, row, data, slot):
                    return  # abandoned: the watchdog reported this job's rows
            except SampleError as error:
                self.row_failed(batch, row.row, error)
            else:
                done += 1
            finally:
                cpu += time.thread_time() - cpu_started
                started, now = now, time.perf_counter()
                decode_s += now - started
                if trace is not None:
                    trace.span("decode", started, now, row.key)
        stats.level("decodes_running", -1)
        if reads:
            stats.add("read", read_s, nbytes, items=reads)
        stats.add("decode", decode_s, cpu_seconds=cpu, items=len(rows))
        if done:
            self.rows_done(batch, done)

    def _timed_out(self, slot: Slot, cause: BaseException, submit: Callable[[Callable[[], None]], None]) -> None:
        """On the watchdog, for a job whose decode it abandoned: the rows done so far are
        reported, the stuck row fails, and the job's other rows go to another thread."""
        batch, rows, index = slot.work, slot.rows, slot.index
        self.stats.level("decodes_running", -1)
        if slot.writes is not None:
            self.poisoned(batch)
        if slot.done:
            self.rows_done(batch, slot.done)
        stage = "read" if slot.reading else "decode"
        self.row_failed(batch, rows[index].row, SampleError(rows[index].key, stage, cause))
        rest = rows[index + 1:]
        if rest:
            submit(lambda: self.fill(batch, rest))

    def _decode_row(self, buffer: BatchBuffer, row: Row, data: Any, slot: Slot) -> bool:
        """Decodes ``row`` and writes it; False, writing nothing more, if the decode was abandoned."""
        arrays = buffer.arrays
        try:
            if self.in_place:  # the decoder writes the row itself
                self.decode.decode_into(data, arrays[0][row.row], (self.epoch, row.index))
                if not slot.claim():
                    return False
                if row.label is not None:
                    write_label(arrays, row.row, row.label)
                return True
            sample = self.decode(data)
        except Exception as error:
            if not slot.claim():
                return False
            raise SampleError(row.key, "decode", error) from error
        if not slot.claim():
            return False
        self.write(buffer, row.row, labelled(sample, row.label), row.key)
        return True

    def write(self, buffer: BatchBuffer, row: int, sample: Any, key: Any) -> None:
        """Copies an already decoded (and labelled) sample into ``row``."""
        started = time.perf_counter()
        try:
            buffer.write(row, sample)
        except Exception as error:
            raise SampleError(key, "decode", error) from error
        ended = time.perf_counter()
        self.stats.add("write", ended - started)
        if self.stats.tracer is not None:
            self.stats.tracer.span("write", started, ended, key)

    def write_job(self, batch: Work, row: int, sample: Any, key: Any) -> None:
        """A decode job for a sample decoded elsewhere (the probe's, which taught the layout)."""
        if batch.cancelled:
            self.rows_done(batch, 1)
            return
        try:
            self.write(batch.buffer, row, sample, key)
        except SampleError as error:
            self.row_failed(batch, row, error)
            return
        self.rows_done(batch, 1)

    def timed_decode(self, data: Any) -> Any:
        """The user's decode of ``data``, counted in the decode stage."""
        started, cpu_started = time.perf_counter(), time.thread_time()
        sample = self.decode(data)
        ended = time.perf_counter()
        self.stats.add("decode", ended - started, cpu_seconds=time.thread_time() - cpu_started)
        if self.stats.tracer is not None:
            self.stats.tracer.span("decode", started, ended)
        return sample


class RowJobs:
    """How the pipeline hands rows of a per-row decoder to the decode threads: each chunk is a
    job at once (``hold`` and ``release`` matter only to a batched decoder's ``BatchJobs``)."""

    def __init__(self, filler: RowFiller, run_job: Callable[[Callable[[], None]], None]) -> None:
        self.filler = filler
        self.run_job = run_job

    def hold(self, batch: Work) -> None:
        pass

    def release(self, batch: Work) -> None:
        pass

    def add(self, batch: Work, rows: list[Row]) -> None:
        self.run_job(lambda: self.filler.fill(batch, rows))


def labelled(sample: Any, label: int | tuple[int, ...] | None) -> Any:
    """The sample with its label field(s): a mix's tuple gives one int64 field each."""
    if label is None:
        return sample
    if type(label) is tuple:
        return (sample, *(np.int64(value) for value in label))
    return sample, np.int64(label)


def write_label(arrays: Sequence[Any], row: int, label: int | tuple[int, ...]) -> None:
    """Writes a row's label field(s), the fields after the decoder's output (a mix's tuple:
    the label, then the source number)."""
    if type(label) is tuple:
        for field, value in enumerate(label, 1):
            arrays[field][row] = value
    else:
        arrays[1][row] = label


def chunk_rows(batch_size: int, threads: int) -> int:
    """Rows a job takes: enough jobs per batch to keep every thread busy twice over (so a slow
    chunk's tail overlaps the next batch), few enough that a job's fixed cost is spread out."""
    return max(1, -(-batch_size // (2 * threads)))


# ----- an item's key and label -----
# The item -> (what to read, label) rule: which part of a source item is read, which is its
# label, and, in a mix, which source it came from. The pipelines apply it to each sample, the
# parent to name a dead child's samples (``procs/parent.py``).

def split(source: Sequence[Any], labelled_items: bool, index: int) -> tuple[Any, Any]:
    """The source item at ``index`` -> (what to read, label or None). In a mix, the label is a
    tuple of the extra int64 fields the rows take: ``(label, source number)``, or
    ``(source number,)`` for unlabelled items (``jobs.write_label`` writes them)."""
    number = None
    if isinstance(source, MixedSource):
        part, local, number = source.locate(index)
        if not isinstance(source, ShardSource):  # a shard mix's own items carry the mix's index: its stream reads by it
            source, index = part, local
    try:
        item = source[index]
    except Exception as error:
        raise SampleError(f"source[{index}]", "source", error) from error
    label = None
    if labelled_items:
        if not is_labelled(item):
            raise SampleError(item, "source", TypeError("expected a (url, label) pair like the first item"))
        item, label = item[0], int(item[1])
    if number is None:
        return item, label
    return item, (number,) if label is None else (label, number)
