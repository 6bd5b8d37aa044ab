"""The backend: what moves the samples, built once per loader by ``build_backend``. In this
process (``processes=0``) it is one pipeline (``pipeline/pipelines.py``'s ``LocalPipeline``) over a
``BufferRing``, counting in a ``LoaderStats``; with ``processes=N`` it is N children
(``procs/``) over a ring of shared-memory segments, counting in the stats that merge theirs. Each
kind makes its own ring and its own stats, with the tracer inside from the start, and the
``window`` of batches the driver keeps under way for it: nothing is made and then replaced.

A loader that changes how it moves samples (in-process to children, say) calls
``build_backend`` again, hands the next pass, or the next batch, to the new backend, and closes
the old one; the epoch's state is the driver's and the loader's, never the backend's.
"""

from __future__ import annotations

import numpy as np
import torch

from .batch.buffers import BufferRing
from .batch.layout import Field, SampleLayout
from .device import DeviceStage
from .pipeline.batched import image_placement
from .pipeline.pipelines import Backend, LocalPipeline, Pipelines
from .procs.merged import ProcessStats
from .procs.parent import ProcessPool
from .settings import LoaderSettings
from .stats.loader_stats import LoaderStats
from .stats.trace import Tracer

LABEL_FIELD = Field((), np.dtype(np.int64))


def window(prefetch: int, processes: int) -> int:
    """Batches the driver keeps under way: ``prefetch``, and with processes enough that every
    child has a batch queued behind its current one."""
    return max(prefetch, 2 * processes)


def build_backend(settings: LoaderSettings, processes: int, *, device_stage: DeviceStage | None,
                  tracer: Tracer | None) -> Backend:
    """The backend for ``settings``: ``processes`` children (0: in this process), each running
    the pipeline on its share of the threads and reads; its stats count the decode threads
    working at first and record into ``tracer``; its ring is allocated at once when the decoder
    declares its output. ``device_stage`` and ``tracer`` are the loader's, kept across backends."""
    device = settings.device
    on_device = image_placement(settings.decode, device, processes)  # what cannot run fails before any start
    layout = known_layout(settings)
    keep = window(settings.prefetch, processes) + 2
    pipelines: Pipelines
    if processes:  # reads and decodes run in the children; the device stage and normalize here
        stats: LoaderStats = ProcessStats(settings.io_concurrency, settings.num_threads, settings.prefetch, processes)
        stats.tracer = tracer  # the children's events are merged into it as they arrive
        pipelines = ProcessPool(processes, settings, stats, keep=keep)
        if layout is not None:
            pipelines.ring.configure(layout, settings.batch_size)
    else:
        stats = LoaderStats(settings.io_concurrency, settings.num_threads, settings.prefetch)
        stats.tracer = tracer
        ring = BufferRing(keep=settings.prefetch + 2, pin_memory=torch.cuda.is_available())
        if layout is not None:
            ring.configure(layout, settings.batch_size, on_device)
        pipelines = LocalPipeline(settings, ring, stats)
    return Backend(pipelines, window(settings.prefetch, processes), processes, device_stage)


def known_layout(settings: LoaderSettings) -> SampleLayout | None:
    """With a decoder that declares its output (the default), the batch layout, so that buffers
    need no first sample: its field, then a label and a mix's source number if the rows carry
    them (int64, on the host). None: the first sample decides (``epoch/dispatch.py``)."""
    output = getattr(settings.decode, "field", None)
    if not isinstance(output, Field):
        return None
    extra = [LABEL_FIELD] * (int(settings.labelled) + int(settings.source_names is not None))  # label, source
    tree, fields = (None, [output]) if not extra else ((None,) * (1 + len(extra)), [output, *extra])
    return SampleLayout(tree, fields)
