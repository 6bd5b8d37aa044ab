"""The hand-out: a complete batch becomes what the user gets, the same in this process and with
child processes.

Without a device the user gets tracked views of the batch buffer (converted first with
``normalize``); the buffer goes back to the ring only once the user has moved past it (see
``BatchBuffer.released``). With a device stage the batch is copied on the side stream; the copy
of batch k+1 starts when batch k is handed out, if k+1 is complete by then, so it overlaps the
user's step.

Fields the source holds in this process (Parquet's string columns: ``host_fields``) never go
through a buffer: the hand-out takes them from the source for the rows delivered, moved as
``close_holes`` moves the rows, and adds them to the batch's dict as lists.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np


from ..batch.assemble import assemble, host_part
from ..batch.buffers import BatchBuffer, hole_moves
from ..batch.layout import SampleLayout
from ..device import DeviceStage, PendingCopy, convert_batch, normalize_fixed
from ..settings import LoaderSettings
from ..stats.loader_stats import LoaderStats
from .in_flight import InFlight


class HandOut:
    """Turns complete batch buffers into the user's batches, on the user's thread."""

    def __init__(self, settings: LoaderSettings, stats: LoaderStats, order: np.ndarray,
                 device_stage: DeviceStage | None = None) -> None:
        self.s = settings
        self.stage = device_stage  # the backend's, with a CUDA device
        self.stats = stats
        self.order = order  # epoch position -> source index
        # Checked once, not per batch: only a source with host fields costs anything at hand-out.
        self._host = settings.source if getattr(settings.source, "string_columns", None) else None
        self.pending_copies: dict[int, PendingCopy] = {}  # batch number -> its copy, started early
        self._handed: BatchBuffer | None = None  # the buffer of the batch the user holds

    def hand_out(self, number: int, buffer: BatchBuffer, positions: Sequence[int], holes: set[int],
                 target: SampleLayout | None = None) -> Any:
        """The user's view of batch ``number``, whose rows (epoch ``positions``) are complete but
        ``holes``; ``target``: the run's layout now (a field may have turned ragged since the
        buffer was taken: ``batch/ragged.py``)."""
        started = time.perf_counter()
        out = self._view(number, buffer, len(positions), holes, target or buffer.layout)
        if self._host is not None:
            add_fields(out, self._host.host_fields(self.order[delivered_rows(positions, holes)]))
        if self.s.collate is not None:
            out = collated(self.s.collate, out, number, positions)
        if self.stats.tracer is not None:
            self.stats.tracer.span("hand out", started, time.perf_counter(), f"batch {number}")
        return out

    def _view(self, number: int, buffer: BatchBuffer, rows: int, holes: set[int], target: SampleLayout) -> Any:
        size = buffer.close_holes(rows, holes)
        if self.s.source_names is not None:  # a mix: its source numbers are the last field, on the host
            self.stats.add_sources(self.s.source_names, buffer.arrays[-1][:size])
        if target is not buffer.layout or target.leaves is not None or buffer.side:
            return self._assembled(number, buffer, size, target)
        stage = self.stage
        if stage is not None:
            pending = self.pending_copies.pop(number, None) or self.start_copy(buffer, size)
            return buffer.layout.unflatten(stage.hand_over(pending))
        if self.s.normalize is not None:  # non-image fields go out as they are: tracked views
            out = buffer.layout.unflatten(convert_batch(buffer.views(size), self.s.normalize))
        else:
            out = buffer.batch(size)
        self._handed = buffer
        return out

    def _assembled(self, number: int, buffer: BatchBuffer, size: int, target: SampleLayout) -> Any:
        """A batch with more than fixed fields (``batch/assemble.py``): its storage copied to the
        device like any batch's (the ragged values with it), or tracked views on the host."""
        stage = self.stage
        if stage is not None:
            pending = self.pending_copies.pop(number, None) or self.start_copy(buffer, size)
            host = getattr(pending, "host", buffer)  # see start_copy
            leaves = assemble(host, stage.hand_over(pending), size, target, stage.device)
            return target.unflatten(normalize_fixed(leaves, stage.normalize))
        leaves = normalize_fixed(assemble(buffer, buffer.views(size), size, target), self.s.normalize)
        self._handed = buffer
        return target.unflatten(leaves)

    def wants_copy(self, number: int) -> bool:
        """Whether batch ``number``'s copy should start now, once it is complete."""
        return self.stage is not None and self.s.in_order and number not in self.pending_copies

    def prefetch_if_complete(self, number: int, batch: InFlight | None) -> None:
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
        assert self.stage is not None
        started = time.perf_counter()
        pending = self.stage.start_copy(buffer, size)
        if buffer.layout.leaves is not None or buffer.side:  # the buffer may be reused before the hand-out
            pending.host = host_part(buffer, size)  # type: ignore[attr-defined]
        ended = time.perf_counter()
        self.stats.add("copy", ended - started, sum(t[:size].nbytes for t in buffer.tensors))
        if self.stats.tracer is not None:
            self.stats.tracer.span("copy to device", started, ended, f"buffer {buffer.slot}")
        return pending

    def release(self) -> None:
        """The user has moved past the batch last handed out (see ``BatchBuffer.released``)."""
        handed, self._handed = self._handed, None
        if handed is not None:
            handed.released()


def delivered_rows(positions: Sequence[int], holes: set[int]) -> list[int]:
    """The epoch positions of a batch's rows as the user gets them: ``close_holes``'s moves
    (``hole_moves``) applied to the list, then cut to the rows filled."""
    rows = list(positions)
    moves, filled = hole_moves(len(rows), holes)
    for hole, row in moves:
        rows[hole] = rows[row]
    return rows[:filled]


def add_fields(out: Any, fields: dict[str, list[Any]]) -> None:
    """Puts ``fields`` into the user's batch: its dict of fields, the batch itself or, labelled,
    its first element (a source with host fields decodes each row to a dict, see ``ColumnsDecoder``)."""
    target = out[0] if isinstance(out, tuple) else out
    if not isinstance(target, dict):
        raise TypeError(f"fields {sorted(fields)} need a batch that is a dict of fields, not {type(target).__name__}")
    target.update(fields)


def collated(collate: Any, batch: Any, number: int, positions: Sequence[int]) -> Any:
    """The user's ``collate`` of a batch; what it raises comes as a ``RuntimeError`` naming the
    batch (its number in the pass and its first epoch positions), the original as its cause."""
    try:
        return collate(batch)
    except Exception as error:
        shown = ", ".join(str(p) for p in list(positions)[:4]) + (", ..." if len(positions) > 4 else "")
        raise RuntimeError(f"collate= failed on batch {number} (epoch positions {shown}): "
                           f"{type(error).__name__}: {error}") from error
