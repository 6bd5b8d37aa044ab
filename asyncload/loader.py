"""AsyncLoader: the public object. It holds the settings, the sampler, the epoch's ledger and
the backend (``backend.py``: one pipeline in this process or N child processes, their ring of
batch buffers and their stats); each iteration is a pass (``epoch/passes.py``) that runs an
``EpochDriver`` (``epoch/driver.py``).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterator, Sequence

import torch

from .autotune import MAX_IO, AutoTuner, Knob
from .backend import build_backend
from .device import DeviceStage
from .epoch.passes import Passes
from .epoch.ledger import Epochs, resume_point
from .io.limits import DEFAULT_MAX_SAMPLE_BYTES
from .order.mix_order import MixSampler
from .order.ranks import Ranks, find_ranks, settle
from .order.sampler import EpochSampler, source_digest
from .order.shard_order import ShardSampler
from .pipeline.pipelines import Backend, Pipelines
from .settings import LoaderSettings, loader_settings
from .sources.mix import MixedSource
from .sources.shards import ShardSource
from .stats.loader_stats import LoaderStats
from .stats.trace import DEFAULT_EVENTS, Tracer
from .switch import adaptive_switch
from .trainers import EpochBatches, SourceDataset


class AsyncLoader:
    """Batches from a sequence of URLs, ``(url, label)`` pairs or keys: reads on an asyncio event
    loop, decodes on threads (native code that releases the GIL) straight into preallocated,
    pinned batch buffers; no worker processes unless ``processes`` asks for them.

    ``for images, labels in loader`` is one pass over an epoch: ``len(loader)`` batches, as
    tensors shaped like the decoded sample with a leading batch dimension (the default decoder:
    uint8 ``[B, 224, 224, 3]`` images and int64 ``[B]`` labels; items without labels give the
    images alone). Each new pass is the next epoch, a new shuffle and new random augmentations,
    as with ``DataLoader(shuffle=True)``; ``set_epoch(k)`` chooses the next pass's epoch instead.

    Args:
        source: a sized, indexable sequence of items: URLs or paths (any fsspec protocol:
            ``s3://``, ``gs://``, ``az://``, local files), ``(url, int label)`` pairs, or keys that
            your ``read`` understands; or ``tar_shards(url)``. ``image_folder``, ``list_files``
            and ``manifest`` build one.
        batch_size (int, default 256): samples per batch. With ``drop_last=False`` the epoch's
            last batch may be smaller. Memory: ``prefetch + 2`` batches are kept allocated.
        shuffle (bool, default True): a new permutation each epoch, from ``(seed, epoch)`` alone
            (the same on every machine); False keeps the source's order, e.g. for evaluation.
        seed (int, default 0): the shuffle's seed; every rank of a job must use the same. Change it
            for another sequence of orders (augmentations follow ``ImageDecoder(seed=...)``).
        drop_last (bool, default False): True drops the epoch's last batch when it would be short,
            so every batch has ``batch_size`` samples, and, with several ranks, the tail that does
            not divide among them instead of padding it with repeats (``DistributedSampler``'s).
        read (default None): how an item becomes what ``decode`` takes. None: the item is a URL
            read whole (object stores through obstore, anything else through fsspec), with
            retries and a timeout. A callable ``read(key)``, plain or ``async``, replaces it (a
            database, an API). False: the item itself goes to ``decode`` (data already in memory,
            or a ``decode`` that reads). Not with ``tar_shards``: the loader reads those.
        decode (default None): what ``read`` returned -> one sample: an array, or a tuple or dict
            of arrays, each of one shape for every sample. None is ``ImageDecoder()`` (JPEG, PNG,
            ... -> uint8 224x224x3, torchvision's Resize + CenterCrop); ``ImageDecoder(size,
            train=True)`` for RandomResizedCrop + flip (with a CUDA ``device`` both run as the GPU
            decode stage, see ``gpu_decode``). It runs on the decode threads: native code that releases the GIL scales with
            them, Python code does not (use ``processes``).
        num_threads (int or "auto", default None): decode threads; None is one per CPU this
            process may use. With several ranks on a node, set it to the cores per rank. "auto"
            starts there and lets the tuner (``loader.tuner``) change how many work.
        io_concurrency (int or "auto", default None): reads in flight. None is 64 for single
            objects and 4 for ``tar_shards`` (ranged reads of up to 16 MiB each). Raise it when
            storage latency is high and the bottleneck is storage; "auto" lets the tuner do so.
        prefetch (int, default 2): batches prepared ahead of the one your loop holds. Raise it
            when read or decode times are uneven; each costs a batch of memory.
        in_order (bool, default True): batches come out in the sampler's order. False lets a
            finished batch pass one that a slow read holds up; ``state_dict`` stays exact.
        device (str or torch.device, default None): None gives tensors in pinned CPU memory;
            ``"cuda"`` (or a CUDA device) gives them on the GPU, copied on a side stream while your
            step works on the previous batch.
        on_error ("raise" or "skip", default "raise"): a sample that cannot be read or decoded
            raises ``SampleError`` at its batch, naming the item, the stage and the cause. "skip"
            gives its row to the epoch's next sample, records it in ``loader.stats.failures``,
            and raises ``TooManyFailures`` past ``max_failures``.
        storage_options (dict, default None): how to reach the storage, in fsspec's names:
            ``endpoint_url``, ``key``/``secret``, ``region``, ``anon``, ...; with
            ``"client": "fsspec"`` object stores are read through fsspec (s3fs, gcsfs) instead.
        rank (int, default None): which part of each epoch this process takes, as with
            ``DistributedSampler``: ranks get disjoint parts of equal length, so every rank gives
            ``len(loader)`` batches (DDP does not hang). None: from an initialised
            ``torch.distributed``, else provisionally torchrun's ``RANK``, else 0 (SLURM's and MPI's
            variables count only through an initialised ``torch.distributed``). Not from a process
            group yet: it is looked at again at every pass's first ``next()`` and every
            ``state_dict``/``load_state_dict`` (Lightning builds the loader before it starts the
            other ranks); ``LOCAL_RANK``/``WORLD_SIZE`` without ``RANK`` (Lightning's launcher)
            leave it unknown until then, and an error names the fix if it still is.
        world_size (int, default None): how many parts (ranks) each epoch is dealt into. None:
            as ``rank``: ``torch.distributed``, else provisionally ``WORLD_SIZE``, else 1, looked
            at again as ``rank`` is.
        max_failures (int or float, default 0.01): with ``on_error="skip"``, the samples an epoch
            may lose before ``TooManyFailures``: a count, or a fraction of the epoch.
        progress (bool, default False): a tqdm bar per pass on standard error, with samples/s and
            the current bottleneck; shown on a terminal only. Needs tqdm installed.
        normalize ((mean, std), default None): turns uint8 NHWC images into float32 NCHW
            ``(x / 255 - mean) / std`` per channel; on the GPU with a CUDA ``device``.
        read_timeout (float, default 60.0): seconds one read may take before it fails (a remote
            read is then retried). Raise it for very large objects on a slow link.
        read_retries (int, default None): None retries a read after a transient error (timeout,
            refused or reset connection, throttling, 5xx) until ``read_retry_seconds`` have
            passed since it first failed (and at least twice), with backoff and jitter (at most
            2 s between tries); an int retries exactly that many times instead (0: fail at the
            first error). A missing object or a refused permission fails at once.
        read_retry_seconds (float, default 60.0): how long a read keeps retrying while storage
            fails (a restart, a burst of 503 SlowDown), with ``read_retries=None``; the read then
            fails naming how long storage failed and the attempts. ``loader.stats`` counts
            ``retries`` and ``retry_wait_seconds``.
        max_sample_bytes (int, default 256 MiB): the largest object one sample may read; a
            larger one fails alone (``SampleError``, skipped with ``on_error="skip"``) before
            it is read whole: local files by their size, object stores by a read that stops
            there, a ``read`` result once returned. None: no limit.
        decode_timeout (float or None, default 120.0): seconds one sample's ``decode`` may run;
            past it the sample fails (``SampleError`` at stage "decode"; skipped with
            ``on_error="skip"``) and its thread, which cannot be stopped, is left to end by itself
            and replaced. Generous, so that a slow first call (a model or JIT loading) is not
            taken for a hang. None: no limit. A decoder that writes its row itself
            (``decode_into``, as ``ImageDecoder``) is timed too (its batch moves to a fresh
            buffer); one of whole batches (``decode_batch``, ``GpuImageDecoder``) is not.
        isolate (bool, default False): the same as ``processes=1``: reads and decodes in one
            child process, away from a training step that holds the GIL.
        processes (int, default None): where reads and decode run. None starts in this process
            and measures: when its stats say Python under one GIL is the limit with cores idle
            (``stats.report()``'s "GIL" verdict), it moves them into child processes at a batch
            boundary, adds children while samples/s rises, and then stays; native decode stays
            here. No sample is lost, repeated or reordered by the move. 0 pins this process; N
            pins N children that read and decode into shared batch buffers. ``"auto"`` is the
            same as None. Children need ``source``, ``read`` and ``decode`` to pickle (define
            them at a module's top level) and a script with ``if __name__ == "__main__":``;
            None without them stays here and says so in one line. ``num_threads`` and
            ``io_concurrency`` are then totals. See docs/guides/processes-auto.md.
        trace (path, default None): writes a timeline of the loader's runs there, as Chrome
            trace-event JSON for Perfetto or chrome://tracing: each sample's read and decode on
            the thread (and process) that ran it, hand-outs, your loop's waits, reads in flight,
            failures. Written when the loader is closed (``close()``, ``with``, or the program's
            exit). ``python -m asyncload.doctor`` writes one for you.
        trace_events (int, default 200,000): the trace keeps the last this many events (about
            200 bytes each), so a long run's memory and file stay bounded.
        collate (callable, default None): called once on each batch as assembled (fixed fields
            as tensors, ragged ones as jagged ``torch.nested`` tensors, others as lists, see
            ``docs/guides/variable-length.md``) when it is handed out; the loop gets what it
            returns (e.g. torchvision detection's ``list[dict]`` targets). What it raises comes as
            a ``RuntimeError`` naming the batch. Runs in this process, on the loop's thread.
        gpu_decode ("auto", True or False, default "auto"): the GPU decode stage. With a CUDA
            ``device`` and the default image decode (``ImageDecoder``, train or not), "auto"
            decodes each batch's JPEGs on the GPU (nvImageCodec, only the crop's region, resized
            and flipped there) while the decode threads take a share of the rows, measured so
            that the batch is ready soonest and smaller when the training step slows; True puts
            every row on the GPU; False keeps the CPU path. Needs ``asyncload[gpu]``; without it
            or without CUDA, "auto" is the CPU path; True where the stage cannot run (no CUDA,
            another decode, an mds/litdata default decode, Parquet ``columns``) and anything
            but a bool or "auto" (0, 1) are a ``ValueError``. The stage runs in this process (with
            ``processes=N`` the children decode instead). See docs/guides/gpu-decode.md.

    Attributes: ``settings`` (read-only: these arguments checked and resolved, one frozen,
    printable ``LoaderSettings`` that every stage and child process reads; e.g. the decode and
    thread counts the defaults chose), ``stats`` (``loader.stats.report()``: time per stage, the bottleneck),
    ``sampler`` (``sampler.order(epoch)``; ``sampler.set_epoch`` is the loader's, for Lightning),
    ``batch_sampler`` (each batch's source indices), ``dataset`` (the source's items),
    ``batch_size``, ``drop_last``, ``epoch`` (what ``state_dict()`` records), ``device``,
    ``tuner`` (with ``"auto"`` settings). ``close()``, or ``with AsyncLoader(...) as loader:``,
    stops its threads and processes.
    """

    prefetch_factor = None  # a DataLoader's without workers: Accelerate's skip_first_batches copies it (trainers.py)

    def __init__(
        self,
        source: Sequence[Any],
        batch_size: int = 256,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        read: Callable[[Any], Any] | bool | None = None,
        decode: Callable[[Any], Any] | None = None,
        num_threads: int | str | None = None,
        io_concurrency: int | str | None = None,
        prefetch: int = 2,
        in_order: bool = True,
        device: str | torch.device | None = None,
        on_error: str = "raise",
        storage_options: dict[str, Any] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        *,
        max_failures: int | float = 0.01,
        progress: bool = False,
        normalize: tuple[Sequence[float], Sequence[float]] | None = None,
        read_timeout: float = 60.0,
        read_retries: int | None = None,
        read_retry_seconds: float = 60.0,
        max_sample_bytes: int | None = DEFAULT_MAX_SAMPLE_BYTES,
        decode_timeout: float | None = 120.0,
        isolate: bool = False,
        processes: int | str | None = None,
        trace: str | os.PathLike | None = None,
        trace_events: int = DEFAULT_EVENTS,
        collate: Callable[[Any], Any] | None = None,
        gpu_decode: bool | str = "auto",
    ) -> None:
        settings = loader_settings(  # every argument, checked and resolved once
            source=source, batch_size=batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last, read=read,
            decode=decode, num_threads=num_threads, io_concurrency=io_concurrency, prefetch=prefetch,
            in_order=in_order, device=device, on_error=on_error, storage_options=storage_options, rank=rank,
            world_size=world_size, max_failures=max_failures, progress=progress, normalize=normalize,
            read_timeout=read_timeout, read_retries=read_retries, read_retry_seconds=read_retry_seconds,
            max_sample_bytes=max_sample_bytes, decode_timeout=decode_timeout, isolate=isolate, processes=processes,
            trace=trace, trace_events=trace_events, collate=collate, gpu_decode=gpu_decode)
        self._settings = settings
        self.device = settings.device
        self._ranks = find_ranks(rank, world_size)  # provisional unless given or from torch.distributed
        self._loaded_under: Ranks | None = None  # the provisional ranks a state not yet resumed was loaded under
        self.sampler = make_sampler(settings, rank=self._ranks.rank or 0, world_size=self._ranks.world_size)
        self._epochs = Epochs()  # which epoch a pass runs, and what it handed out
        self.sampler.follow = self._epochs.choose  # Lightning's sampler.set_epoch (no reference to the loader)
        self.dataset = SourceDataset(source)  # what the trainers read (trainers.py)
        self.batch_sampler = EpochBatches(self.sampler, self._epochs.upcoming)
        self._order_identity = {**self.sampler.identity(), "source": source_digest(source)}
        self._passes = Passes(self._epochs)  # the pass running, if any
        self._closed = False
        self.progress = progress
        stage = DeviceStage(settings.device, settings.normalize) if settings.device is not None else None
        tracer = Tracer(settings.trace, settings.trace_events) if settings.trace is not None else None
        self._backend = build_backend(settings, settings.processes, device_stage=stage, tracer=tracer)
        self._use(self._backend)
        self._switch = adaptive_switch(settings, self._backend, self._use)  # moves to children when the GIL is the limit

    @property
    def settings(self) -> LoaderSettings:
        """The loader's arguments, checked and resolved (read-only): what every stage runs with."""
        return self._settings

    def _use(self, backend: Backend) -> None:
        """The backend that moves the samples from now on (``processes=None`` switches): its stats
        are the loader's, its tuner the loader's."""
        self._backend = backend
        self.stats = backend.stats
        self.tuner = make_tuner(self.stats, backend.pipelines, self._settings, backend.processes)

    def __len__(self) -> int:
        """Batches in one epoch for this rank (the same on every rank)."""
        self._settle_ranks(strict=False)
        return len(self.sampler)

    @property
    def batch_size(self) -> int:
        """Samples per batch (the last batch of an epoch may have fewer, unless ``drop_last``)."""
        return self.sampler.batch_size

    @property
    def drop_last(self) -> bool:
        return self.sampler.drop_last

    def _settle_ranks(self, strict: bool) -> None:
        """Provisional ranks (from the environment, or none) are looked at again each time the
        loader is used, until an initialised ``torch.distributed``'s replace them: Lightning
        builds the loader in rank 0 before it launches the other ranks and initialises the group,
        and a batch looked at (or a state loaded) before ``fit`` must not pin rank 0 of 1.
        ``strict``: a pass or a state needs the rank, so an unknown one is an error that names
        the fix; so is a state loaded under a guess that ``torch.distributed`` now contradicts."""
        if self._ranks.settled:
            return
        ranks = settle(self._ranks, (self._settings.rank, self._settings.world_size), strict)
        loaded = self._loaded_under
        if loaded is not None and (ranks.rank, ranks.world_size) != (loaded.rank, loaded.world_size):
            raise ValueError(
                f"load_state_dict() ran before torch.distributed was initialised, for rank {loaded.rank} of "
                f"{loaded.world_size} (a guess from the environment), but this process is rank {ranks.rank} of "
                f"{ranks.world_size}: call load_state_dict() after torch.distributed.init_process_group() (Lightning "
                f"and Accelerate restore the loader's state after it), or pass AsyncLoader(rank=..., world_size=...)")
        self._ranks = ranks
        self.sampler.rank, self.sampler.world_size = ranks.rank or 0, ranks.world_size

    def set_epoch(self, epoch: int) -> None:
        """Makes the next pass over the loader epoch ``epoch``: its shuffle (from ``(seed,
        epoch)``) and its augmentations, as ``DistributedSampler.set_epoch``. Optional: without it
        each new pass runs the epoch after the last one. Call it with the same epoch on every
        rank. After ``load_state_dict``, calling it with the saved epoch keeps the resume; another
        epoch starts that one from its beginning."""
        self._epochs.choose(epoch)

    @property
    def epoch(self) -> int:
        """The epoch ``state_dict()`` records: the pass running or left, or after a pass that
        ended, the next one."""
        return self._epochs.epoch

    def __iter__(self) -> Iterator[Any]:
        """One pass, which begins at the first ``next()`` (as a ``DataLoader``'s sampler does): an
        iterator dropped before it reads nothing and uses up no epoch (Lightning makes one to check
        the loader is iterable), and ``set_epoch`` between ``iter()`` and the first ``next()``
        applies. The pass gives the epoch's batches (``len(self)``, fewer only where
        ``on_error="skip"`` left none to fill a batch), prepared ``prefetch`` ahead. The pass runs
        ``set_epoch``'s epoch, else the rest of a ``load_state_dict`` epoch, else the epoch after
        the last pass (whether that pass ended or was left early, as a new pass of
        ``DataLoader(shuffle=True)`` is a new order). A new pass ends one still running, at its
        first ``next()``. Leaving the loop (``break``, an exception) stops the threads; a batch
        stays valid while you hold it."""
        if self._closed:
            raise RuntimeError("this AsyncLoader is closed")
        return self._pass()

    def _pass(self) -> Iterator[Any]:
        """The body runs at the first ``next()``: only then does the pass start (its first
        batches under way at once, ``prefetch`` ahead)."""
        if self._closed:
            raise RuntimeError("this AsyncLoader is closed")
        self._settle_ranks(strict=True)  # Lightning has initialised the process group by now
        self._loaded_under = None  # a loaded state is resumed by this pass, under these ranks
        yield from self._passes.start(self._backend, self._settings, self.sampler, self.tuner, self.progress, self,
                                      self._switch)

    def state_dict(self) -> dict[str, Any]:
        """Where the epoch stands, to save with a checkpoint: ``epoch`` and which positions of its
        order were handed out (as a few intervals: one, ``[0, n)``, unless samples were skipped or
        batches came out of order), which failed and were skipped, which were repeated as DDP
        padding; and the settings that decide the order, which ``load_state_dict`` checks. Taken
        in the loop, or after leaving it early, it describes the epoch of that pass; after a pass
        that ended, the next epoch, with nothing delivered yet; after an elastic resume (another
        world size), an ``elastic`` entry, what recomputes its rest. Small. ``in_step``: batches
        come in order and no sample was skipped, so any rank that handed out as many batches
        stands at the same positions of its own part: rank 0's state alone resumes every rank
        (DDP keeps them in step); else save every rank's (``load_state_dict`` takes the list)."""
        self._settle_ranks(strict=True)
        in_step = self._settings.in_order and not self._settings.skip_errors
        return self._epochs.state(self.sampler, self._order_identity, in_step)

    def load_state_dict(self, state: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Resumes from ``state_dict()`` (of a loader with the same source and order settings;
        else ``ValueError`` names the difference): the next pass runs the saved epoch and delivers
        what it had not yet delivered, batch for batch as the uninterrupted run would have, with no
        delivered sample read again. ``set_epoch`` with the saved epoch keeps this; the pass after
        it is the next epoch. Another rank's state at the same world size resumes this rank where
        it is ``in_step`` (a checkpoint written by rank 0 alone); else ``ValueError`` says how to
        gather every rank's. Nothing here waits on the other ranks. At another world size than the
        state's, pass the list of every old rank's ``state_dict()`` (the same list on every new
        rank): the pass then runs the samples no old rank delivered or skipped, each once, in a
        seeded order dealt to the new ranks (equal batch counts, fewer than ``len(loader)``); the
        next epoch is the new world size's."""
        self._loaded_under = None  # a state loaded before is replaced: no longer to check
        state, elastic = resume_point(state, self.sampler, self.state_dict())  # state_dict() settles the ranks
        if elastic is not None:
            elastic.order(self.sampler, state["epoch"])  # refused now (a mix, say), not at the next iter()
        self._epochs.load(state, self.sampler.batch_size, elastic)
        self._loaded_under = None if self._ranks.settled else self._ranks

    def close(self) -> None:
        """Stops every thread and child process and frees the batch buffers (also done by ``with``
        and by garbage collection); a pass still running ends, and a new one raises
        ``RuntimeError``. Idempotent; a close cut short (Ctrl-C while it waits for the threads) is
        finished by the next."""
        self._closed = True
        self._passes.stop()
        self._backend.close()
        if self._switch is not None:
            self._switch.close()
        if self.stats.tracer is not None:
            self.stats.tracer.finish()  # the children's events came with their answers

    def __enter__(self) -> "AsyncLoader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def make_sampler(settings: LoaderSettings, rank: int, world_size: int) -> EpochSampler:
    """The epoch's order over the source: a tar shard source's keeps each rank on a few shards; a
    mix's is its seeded mixed sequence."""
    source = settings.source
    order = dict(shuffle=settings.shuffle, seed=settings.seed, drop_last=settings.drop_last, rank=rank,
                 world_size=world_size)
    if isinstance(source, MixedSource):
        return MixSampler(source, settings.batch_size, **order)
    if isinstance(source, ShardSource):
        return ShardSampler(source, settings.batch_size, **order)
    return EpochSampler(len(source), settings.batch_size, **order)


def make_tuner(stats: LoaderStats, pipelines: Pipelines, settings: LoaderSettings, processes: int) -> AutoTuner | None:
    """With ``"auto"`` settings, a tuner whose knobs act on the pipelines (totals over the
    processes, each taking its share): threads from ``num_threads`` up to the threads started,
    reads in flight from ``io_concurrency``."""
    if not (settings.auto_threads or settings.auto_io):
        return None
    low = max(1, processes)
    thread_knob = (Knob("num_threads", settings.num_threads, low, settings.threads_started,
                        apply=lambda value: pipelines.set_limits(value, None)) if settings.auto_threads else None)
    io_knob = (Knob("io_concurrency", settings.io_concurrency, low, MAX_IO,
                    apply=lambda value: pipelines.set_limits(None, value)) if settings.auto_io else None)
    return AutoTuner(stats, thread_knob, io_knob)
