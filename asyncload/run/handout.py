"""The hand-out: a complete batch becomes what the user gets, the same in this process and with
child processes.

Without a device the user gets tracked views of the batch buffer (converted first with
``normalize``); the buffer goes back to the ring only once the user has moved past it (see
``BatchBuffer.released``). With a device stage the batch is copied on the side stream; the copy
of batch k+1 starts when batch k is handed out, if k+1 is complete by then, so it overlaps the
user's step.
"""

from __future__ import annotations

import time
from typing import Any

from ..batch.buffers import BatchBuffer
from ..device import PendingCopy, convert_batch
from .in_flight import Batch
from .settings import Settings


class HandOut:
    """Turns complete batch buffers into the user's batches, on the user's thread."""

    def __init__(self, settings: Settings) -> None:
        self.s = settings
        self.pending_copies: dict[int, PendingCopy] = {}  # batch number -> its copy, started early
        self._handed: BatchBuffer | None = None  # the buffer of the batch the user holds

    def hand_out(self, number: int, buffer: BatchBuffer, rows: int, holes: set[int]) -> Any:
        """The user's view of batch ``number``, whose ``rows`` rows are complete but ``holes``."""
        started = time.perf_counter()
        out = self._view(number, buffer, rows, holes)
        if self.s.stats.tracer is not None:
            self.s.stats.tracer.span("hand out", started, time.perf_counter(), f"batch {number}")
        return out

    def _view(self, number: int, buffer: BatchBuffer, rows: int, holes: set[int]) -> Any:
        size = buffer.close_holes(rows, holes)
        if self.s.source_names is not None:  # a mix: its source numbers are the last field, on the host
            self.s.stats.add_sources(self.s.source_names, buffer.arrays[-1][:size])
        stage = self.s.device_stage
        if stage is not None:
            pending = self.pending_copies.pop(number, None) or self.start_copy(buffer, size)
            return buffer.layout.unflatten(stage.hand_over(pending))
        if self.s.normalize is not None:  # non-image fields go out as they are: tracked views
            out = buffer.layout.unflatten(convert_batch(buffer.views(size), self.s.normalize))
        else:
            out = buffer.batch(size)
        self._handed = buffer
        return out

    def wants_copy(self, number: int) -> bool:
        """Whether batch ``number``'s copy should start now, once it is complete."""
        return self.s.device_stage is not None and self.s.in_order and number not in self.pending_copies

    def prefetch_if_complete(self, number: int, batch: Batch | None) -> None:
        """With a device stage: if batch ``number`` is already complete (no errors, no holes),
        start its copy now."""
        if batch is None or not self.wants_copy(number):
            return
        if batch.complete() and not batch.errors and not batch.holes:
            assert batch.buffer is not None
            self.prefetch_copy(number, batch.buffer, len(batch.positions))

    def prefetch_copy(self, number: int, buffer: BatchBuffer, rows: int) -> None:
        """Starts the copy of complete batch ``number`` (no holes, no errors) ahead of its turn,
        so that it runs on the side stream while the user works on the batch just handed out."""
        self.pending_copies[number] = self.start_copy(buffer, rows)

    def start_copy(self, buffer: BatchBuffer, size: int) -> PendingCopy:
        """Issues a batch's host-to-device copy. The stats count batches and bytes and the host
        time to issue it; the copy itself runs on the GPU, overlapped, unmeasured by design."""
        assert self.s.device_stage is not None
        started = time.perf_counter()
        pending = self.s.device_stage.start_copy(buffer, size)
        ended = time.perf_counter()
        self.s.stats.add("copy", ended - started, sum(t[:size].nbytes for t in buffer.tensors))
        if self.s.stats.tracer is not None:
            self.s.stats.tracer.span("copy to device", started, ended, f"buffer {buffer.number}")
        return pending

    def release(self) -> None:
        """The user has moved past the batch last handed out (see ``BatchBuffer.released``)."""
        handed, self._handed = self._handed, None
        if handed is not None:
            handed.released()
