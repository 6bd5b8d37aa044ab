"""Batched decoders (``batched = True``, ``decode_batch`` and ``field``: ``GpuImageDecoder``):
one decode job per batch instead of one per chunk of rows.

With a decoder that shares its batches with the CPU (a ``policy``: the GPU decode stage,
``decode/split.py``), the gathered rows are cut in two: the policy's count goes to one GPU call,
the rest to the CPU decode threads in chunks (``decode_batch(..., cpu_share=True)``), all at
once, so that the batch is complete when both are. In ``"auto"``, a row whose header says the GPU would refuse
it (not a JPEG, CMYK, lossless, over the pixel budget, ...) never enters a GPU call: with its
bytes in hand it joins the CPU's chunks at the cut; a local file, read by the GPU job, is sent
from there to CPU jobs of its own before the GPU call. Both are counted as fallbacks, by reason
(``stats.decoded_on_cpu_why``). The policy hears of the training step's time (``stats.step``)
before each cut.

nvJPEG pays off on many images at once, so the rows of a batch are gathered on the event loop
until none of them is still being read, then go to a decode thread as one ``decode_batch`` call.
A failed row takes the failure path of every decoder (``row_failed``): with ``on_error="skip"``
its replacement is read, gathered and decoded in a call of its own, into the same row. The keys
are ``(epoch, source index)``, as ``RowFiller`` gives ``decode_into``, so the same seed gives
``ImageDecoder``'s crops.

Where the images live: a decoder on the CPU writes the host batch buffer, as any decoder. One on
a CUDA device writes a buffer field allocated on that device (``OnDevice``), on a side stream of
its own; the events it returns go with the buffer (``BatchBuffer.writes``), and the device stage
waits on them before it clones the field for the user.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import torch

from ..batch.buffers import OnDevice
from ..batch.layout import Field
from ..errors import SampleError
from ..cache.items import KeptRead
from .jobs import Row, RowFiller, Work, read_on_decode_thread, write_label

IMAGE_FIELD = 0  # the decoder's output is the sample's first field; the label, if any, the second
MIN_CPU_ROWS = 4  # the CPU share goes to the threads in jobs of at least this many rows: a job costs Python


def is_batched(decode: Any) -> bool:
    """Whether ``decode`` decodes whole batches: ``batched = True``, ``decode_batch``, and a
    ``field`` that declares its output."""
    return (getattr(decode, "batched", False) is True and callable(getattr(decode, "decode_batch", None))
            and isinstance(getattr(decode, "field", None), Field))


def image_placement(decode: Any, device: torch.device | None, processes: int) -> OnDevice | None:
    """Where a batched decoder's images live: None for the host buffer (any other decoder, or a
    batched one on the CPU, whose rows are copied up as usual), else the CUDA field and the side
    stream that decodes into it. What the loader cannot run fails here, at construction."""
    if not is_batched(decode):
        return None
    if processes:
        raise ValueError("a batched decoder (decode_batch) runs in-process, on the GPU's side stream: "
                         "it cannot be used with processes=N or isolate=True")
    own = torch.device(getattr(decode, "device", None) or "cpu")
    if own.type == "cpu":
        return None
    if device is None:
        raise ValueError(f"the decoder runs on {own}, but the loader has device=None: pass device={str(own)!r} "
                         "so that its batches stay there")
    if own.type == "cuda" and own.index is None:
        own = torch.device("cuda", torch.cuda.current_device())
    if own != device:
        raise ValueError(f"the decoder runs on {own}, but the loader's device is {device}: they must be the same")
    return OnDevice(frozenset({IMAGE_FIELD}), torch.cuda.Stream(device))


@dataclass
class _Gathering:
    holds: int = 0
    rows: list[Row] = field(default_factory=list)


class BatchJobs:
    """Both sides of the batched decode: ``hold``/``add``/``release`` on the event loop gather
    a batch's rows, ``fill`` decodes them on a decode thread.

    The producer holds a batch while it submits rows to it and while each of its reads is in
    flight, and adds the rows whose bytes are here (local files: the job reads them). The last
    release sends what has gathered as one job through ``run_job``. A replacement submitted
    while other rows are still held joins their job; one submitted later makes its own.
    The decoder, the epoch, the stats and how rows are read and reported are ``filler``'s: the
    per-row jobs' own."""

    def __init__(self, filler: RowFiller, run_job: Callable[[Callable[[], None]], None]) -> None:
        self.filler = filler  # the run's decoder, epoch, stats and reporting, shared with per-row jobs
        self.run_job = run_job
        self._gathering: dict[int, _Gathering] = {}  # batch number -> rows waiting; loop only
        self._steps_seen = 0  # the training steps the split policy has heard of

    # ----- the event loop -----

    def hold(self, batch: Work) -> None:
        """A row of ``batch`` may still come: do not send its job yet."""
        self._gathering.setdefault(batch.fill_id, _Gathering()).holds += 1

    def add(self, batch: Work, rows: Sequence[Row]) -> None:
        """Rows ready to decode (bytes read, or a local file the job reads); under a hold."""
        self._gathering[batch.fill_id].rows.extend(rows)

    def release(self, batch: Work) -> None:
        """Ends a hold; the last one sends the gathered rows as one decode job."""
        gathering = self._gathering[batch.fill_id]
        gathering.holds -= 1
        if gathering.holds == 0:
            del self._gathering[batch.fill_id]
            for rows, cpu_share in self.shares(gathering.rows):
                self.run_job(lambda rows=rows, cpu_share=cpu_share: self.fill(batch, rows, cpu_share))

    def shares(self, rows: list[Row]) -> list[tuple[list[Row], bool]]:
        """The jobs for ``rows``: one call of the whole decoder, or with a split policy its GPU
        share first, then the CPU share in chunks over the other decode threads."""
        policy = getattr(self.filler.decode, "policy", None)
        if not rows or policy is None:
            return [(rows, False)] if rows else []
        stats = self.filler.stats
        policy.cpu_threads = max(1, stats.limits.get("num_threads", 1) - 1)  # one waits on the GPU call
        policy.cpu_chunk = MIN_CPU_ROWS  # the CPU's probe share: one job's worth
        step = stats.last_step()
        if step is not None and step[0] != self._steps_seen:
            self._steps_seen = step[0]
            policy.step(step[1])
        rows, refused = self._gpu_candidates(rows, policy)
        on_gpu = policy.gpu_rows(len(rows)) if rows else 0
        policy.cpu_only(len(refused))
        jobs = [(rows[:on_gpu], False)] if on_gpu else []
        rest = rows[on_gpu:] + refused
        jobs += [(chunk, True) for chunk in self._cpu_chunks(rest)]
        stats.gpu_decode_choice = policy.describe()
        if stats.tracer is not None:  # the cut of each batch, and why, on the timeline
            stats.tracer.instant("gpu split", {"gpu": on_gpu, "cpu": len(rest), "why": policy.why})
        return jobs

    def _cpu_chunks(self, rows: list[Row]) -> list[list[Row]]:
        """``rows`` cut into the CPU share's jobs: spread over the decode threads but one (it
        waits on the GPU call), at least ``MIN_CPU_ROWS`` each."""
        threads = max(1, self.filler.stats.limits.get("num_threads", 1) - 1)
        per_job = max(MIN_CPU_ROWS, -(-len(rows) // threads))
        return [rows[start:start + per_job] for start in range(0, len(rows), per_job)]

    def _gpu_candidates(self, rows: list[Row], policy: Any) -> tuple[list[Row], list[Row]]:
        """The rows whose bytes are here and whose header the GPU would refuse (``refused``:
        not a JPEG, CMYK, over the pixel budget, ...) go to the CPU jobs from the start rather
        than one after another on the GPU job's thread, counted as fallbacks with their reasons;
        the rest, and rows not read yet (local files, item-cache copies: the GPU job reads them,
        then sends those it finds refused to CPU jobs, ``_route_refused``), are shared by the
        policy. A pinned mode keeps every row where it says (``"gpu"``: refusals fall back on
        the GPU job, as ``gpu_decode=True`` asks)."""
        refuses = getattr(self.filler.decode, "refused", None)
        if policy.mode != "auto" or refuses is None:
            return rows, []
        known = [number for number, row in enumerate(rows) if isinstance(row.data, (bytes, bytearray, memoryview))]
        why = {known[number]: reason for number, reason in refuses([rows[number].data for number in known]).items()}
        self._count_fallbacks(why.values())
        return ([row for number, row in enumerate(rows) if number not in why],
                [row for number, row in enumerate(rows) if number in why])

    def _route_refused(self, batch: Work, rows: list[Row], datas: list[Any], read_here: set[int],
                       cpu_share: bool) -> tuple[list[Row], list[Any]]:
        """Once a job's local files are read (``read_here``: their positions), those whose header
        the GPU would refuse are counted as fallbacks with their reasons, as at the cut, so the
        counts do not depend on the split. In the GPU job they also go to CPU jobs of their own,
        at once and spread over the decode threads, before the GPU call is made; returns the
        rows left to this job. (Refused on the GPU job's thread instead, a batch's PNGs were
        decoded one after another there while the other threads waited.)"""
        refuses = getattr(self.filler.decode, "refused", None)
        policy = getattr(self.filler.decode, "policy", None)
        if refuses is None or policy is None or policy.mode != "auto" or not read_here:
            return rows, datas
        positions = sorted(read_here)
        why = {positions[number]: reason for number, reason in refuses([datas[at] for at in positions]).items()}
        if not why:
            return rows, datas
        self._count_fallbacks(why.values())
        if cpu_share:  # already on the CPU path
            return rows, datas
        policy.moved_to_cpu(len(why))
        refused = [replace(rows[at], data=datas[at]) for at in sorted(why)]
        for chunk in self._cpu_chunks(refused):
            self.run_job(lambda chunk=chunk: self.fill(batch, chunk, True))
        keep = [at for at in range(len(rows)) if at not in why]
        return [rows[at] for at in keep], [datas[at] for at in keep]

    def _count_fallbacks(self, reasons: Any) -> None:
        """Rows the GPU leaves to the CPU path, in ``stats`` by reason."""
        counts = Counter(reasons)
        if counts:
            self.filler.stats.add_decoded_on_cpu(sum(counts.values()), counts)

    # ----- a decode thread -----

    def fill(self, batch: Work, rows: list[Row], cpu_share: bool = False) -> None:
        """A decode job: reads the local rows, decodes every row with one ``decode_batch`` call
        (``cpu_share``: the decoder's CPU path), writes the labels, then reports the rows done
        once and each failure on its own."""
        if batch.cancelled:
            self.filler.rows_done(batch, len(rows))
            return
        self.filler.stats.level("decodes_running", 1)
        try:
            rows, datas, read_here = self._read(batch, rows)
            rows, datas = self._route_refused(batch, rows, datas, read_here, cpu_share)
            if rows:
                self._decode(batch, rows, datas, cpu_share)
        finally:
            self.filler.stats.level("decodes_running", -1)

    def _read(self, batch: Work, rows: list[Row]) -> tuple[list[Row], list[Any], set[int]]:
        """The rows whose bytes are here, with their bytes: local files are read now (their
        positions in what is returned: the third value)."""
        ready, datas, read_here = [], [], set()
        read_s, nbytes, reads = 0.0, 0, 0
        for row in rows:
            data = row.data
            if data is None or isinstance(data, KeptRead):
                started = time.perf_counter()
                try:
                    if data is None:
                        data = read_on_decode_thread(row.key, self.filler.read_other, self.filler.max_bytes)
                    else:  # a cache's kept copy (not a read from storage: not counted as one)
                        data = data.read()
                except Exception as error:
                    self.filler.row_failed(batch, row.row, SampleError(row.key, "read", error))
                    continue
                finally:
                    ended = time.perf_counter()
                    read_s += ended - started
                    if self.filler.stats.tracer is not None:
                        self.filler.stats.tracer.span("read", started, ended, row.key)
                if row.data is None:
                    reads += 1
                    nbytes += len(data)
                read_here.add(len(ready))
            ready.append(row)
            datas.append(data)
        if reads:
            self.filler.stats.add("read", read_s, nbytes, items=reads)
        return ready, datas, read_here

    def _decode(self, batch: Work, rows: list[Row], datas: list[Any], cpu_share: bool = False) -> None:
        """One ``decode_batch`` call for ``rows``, then every row reported exactly once: done, or
        failed with its error. Whatever goes wrong between (the call raises, returns failures
        numbered otherwise than ``datas``, a label does not fit) fails every row rather than
        leaving the batch incomplete for ever."""
        buffer = batch.buffer
        started, cpu_started = time.perf_counter(), time.thread_time()
        try:
            failures, event = self._call(buffer, rows, datas, cpu_share)
        except Exception as error:  # not one file's fault, but no row may be lost: each one fails
            whole = RuntimeError(f"{type(self.filler.decode).__name__}.decode_batch of {len(rows)} rows failed: "
                                 f"{type(error).__name__}: {error}")
            whole.__cause__ = error
            failures, event = dict.fromkeys(range(len(rows)), whole), None
        ended = time.perf_counter()
        self.filler.stats.add("decode", ended - started, cpu_seconds=time.thread_time() - cpu_started, items=len(rows))
        if self.filler.stats.tracer is not None:  # one call for the batch's rows: one span
            share = " (CPU share)" if cpu_share else ""
            self.filler.stats.tracer.span("decode", started, ended, f"{len(rows)} rows{share}")
        if event is not None:
            buffer.writes.append(event)  # before the rows are done: the batch's copy waits on it
        for number, error in failures.items():
            self.filler.row_failed(batch, rows[number].row, SampleError(rows[number].key, "decode", error))
        if len(rows) > len(failures):
            self.filler.rows_done(batch, len(rows) - len(failures))

    def _call(self, buffer: Any, rows: list[Row], datas: list[Any], cpu_share: bool
              ) -> tuple[dict[int, Exception], Any]:
        """``decode_batch`` into ``buffer``, its result checked, the labels written: (failures
        numbered as ``rows``, the event that ends its writes or None)."""
        stream = buffer.on_device.stream if buffer.on_device is not None else None
        share = {"cpu_share": True} if cpu_share else {}  # a decoder without a policy never gets it
        result = self.filler.decode.decode_batch(
            datas, [(self.filler.epoch, row.index) for row in rows], buffer.tensors[IMAGE_FIELD], stream=stream,
            rows=[row.row for row in rows], **share)
        failures, event, on_cpu = result[:3]
        if not isinstance(failures, dict) or not set(failures) <= set(range(len(rows))):
            raise TypeError(f"its failures must be a dict keyed by positions in datas (0..{len(rows) - 1}), "
                            f"got {failures!r}")
        if on_cpu:  # the reasons where the decoder gives them (GpuImageDecoder's BatchResult.why)
            why = getattr(result, "why", {})
            self.filler.stats.add_decoded_on_cpu(len(on_cpu), Counter(why[row] for row in on_cpu if row in why))
        if len(buffer.tensors) > 1:  # label fields (a mix's source number too)
            for number, row in enumerate(rows):
                if number not in failures:
                    write_label(buffer.arrays, row.row, row.label)
        return failures, event
