"""One sample into one row: the steps every way of filling a batch has in common.

``RowWriter.write`` decodes and writes the row (the decoder's ``decode_into`` straight into the row when it declares its output,
else a copy through ``BatchBuffer.write``), counting decode time and CPU in the stats. What to
read and its label come from ``run.settings.split``, shared with the in-process run.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from ..batch.buffers import BatchBuffer
from ..errors import SampleError
from ..io.reader import Reader
from ..run.jobs import decodes_in_place, labelled, read_plain_file
from ..stats.figures import LoaderStats


def read_local(reader: Reader, key: str) -> bytes:
    """A local file, read on the calling decode thread (cheaper than a hand-off): a regular file
    with a few system calls, anything else (``memory://``, a FIFO) through the reader's timeout."""
    try:
        started = time.perf_counter()
        data = read_plain_file(key)
        if data is None:
            return reader.read_local(key)  # counts itself in the stats
        reader.stats.add("read", time.perf_counter() - started, len(data))
        return data
    except Exception as error:
        raise SampleError(key, "read", error) from error


class RowWriter:
    """Decodes samples into batch rows with ``decode``."""

    def __init__(self, decode: Callable[[Any], Any], stats: LoaderStats) -> None:
        self.decode = decode
        self.stats = stats
        self.in_place = decodes_in_place(decode)

    def write(self, buffer: BatchBuffer, row: int, key: Any, data: Any, label: int | None, seed_key: tuple[int, int]) -> None:
        """Decodes ``data`` into row ``row`` of ``buffer``; ``seed_key`` (epoch, index) seeds a
        decoder's random transforms, so pixels do not depend on which thread or process ran it.
        The thread's CPU time is counted beside the wall time: a thread waiting for the GIL is
        in its decode but gets no CPU, which is how the report tells the GIL from busy cores."""
        stats = self.stats
        stats.level("decodes_running", 1)
        started, cpu_started = time.perf_counter(), time.thread_time()
        try:
            if self.in_place:
                rows = buffer.rows(row)
                self.decode.decode_into(data, rows[0], seed_key)  # type: ignore[attr-defined]
                if label is not None:
                    rows[1][...] = label
            else:
                sample = self.decode(data)
        except Exception as error:
            raise SampleError(key, "decode", error) from error
        finally:
            stats.level("decodes_running", -1)
        stats.add("decode", time.perf_counter() - started, cpu_seconds=time.thread_time() - cpu_started)
        if not self.in_place:
            started = time.perf_counter()
            try:
                buffer.write(row, labelled(sample, label))
            except Exception as error:
                raise SampleError(key, "decode", error) from error
            stats.add("write", time.perf_counter() - started)
