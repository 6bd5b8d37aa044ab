"""The GPU decode stage: a batch's JPEGs decoded on the GPU, only the crop's region, and resized
and flipped there, beside the CPU decode threads.

Past what the CPU cores can decode (a 16-core H200 node stops at 4,500-6,300 img/s, libjpeg-turbo
being most of the CPU per image), the decode moves to the GPU: nvImageCodec (``nvimgcodec.py``)
decodes each batch's JPEGs in one call, only the region the transform reads (the random crop's box
with ``train=True``, the centre crop's lines in eval), and the antialiased resize (torchvision's
filter) and the flip run in torch on the same device, into the batch the user gets: no pixel goes
through host memory. The boxes and flips are ``ImageDecoder``'s, from the same ``(seed, key)``, so
both paths give the same augmentation stream and a row may be decoded by either.

What the GPU does not take goes through the CPU path (``ImageDecoder``) into a pinned staging row
and is copied up, alone, counted in ``stats.decoded_on_cpu`` and by reason in
``stats.decoded_on_cpu_why``: from its header (``gpu_refusal``, before any GPU memory is taken)
not a JPEG, one not ending with its EOI marker (truncated: nvJPEG might decode it silently;
or with data appended after the marker, which the CPU path decodes), a frame
nvImageCodec has no GPU decoder for with a region (lossless, arithmetic, hierarchical, more than
8 bits), CMYK/YCCK or RGB-coded, over the pixel budget; then one nvImageCodec refuses (a ``None`` result) or
fails on (out of GPU memory included; a call that failed as a whole is retried one image at a
time first). One image never fails the batch; one neither path decodes fails as it would without
the stage (``SampleError``, or skipped). A JPEG corrupt inside its scans, behind a valid header
and end marker, may decode on the GPU (as with PIL) where the strict CPU path refuses it.

Beside it the loader sends a share of each batch's rows to the CPU decode threads
(``decode_batch(..., cpu_share=True)``): ``policy`` (``split.py``) chooses the share from the
measured rates and the training step's time.

Streams: everything here runs inside ``torch.cuda.stream(stream)``; the decode is ordered on it
too (``nvimgcodec.py`` says what was checked in nvImageCodec's source). The returned event marks
its end, for the device stage to wait on (never the host). nvImageCodec's output memory is freed
when its images are, stream-ordered on that same stream (``cudaFreeAsync``), so reading it there
is safe anyway; a batch's images are still kept until the next batch, which first waits (on its
decode thread) for the kernels that read them: a belt for allocators that are not stream-ordered.
The antialiased resize runs in float32 on the GPU: PyTorch's CUDA kernel for it takes no uint8
(``AT_DISPATCH_FLOATING_TYPES_AND2(Half, BFloat16)`` in ``UpSampleBilinear2d.cu``); a downscale
too steep for its shared memory raises, and that row goes to the CPU path.
"""

from __future__ import annotations

import threading
import time
import warnings
from contextlib import nullcontext
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import simplejpeg
import torch

from ..batch.layout import Field
from .budget import DEFAULT_MAX_PIXELS
from .geometry import Box
from .image import JPEG_MAGIC, ImageDecoder, Plan
from .resize import centre_crop_of_region, centre_crop_region, resize_aa
from .split import SplitPolicy

Key = tuple[int, ...] | None
RegionDecode = Callable[[Sequence[bytes], Sequence[Box | None], Any], list[torch.Tensor | None]]
JPEG_END = b"\xff\xd9"  # the EOI marker: a JPEG without it at its end is truncated
# simplejpeg's names. Not "RGB" (three components coded without a colour transform, said by an Adobe
# APP14 marker and no JFIF one): nvImageCodec's parser files every 3-component JPEG as YCbCr
# ("assume that 3 channels is always going to be YCbCr", src/parsers/jpeg.cpp), so the GPU would
# convert it as YCbCr, wrong colours without an error; CMYK and YCCK go to the CPU too.
GPU_COLOURSPACES = ("YCbCr", "Gray")
# The frames nvImageCodec decodes on the GPU (its nvjpeg_cuda_decoder; the hardware engines take a
# subset and hand the rest to it): baseline, extended sequential and progressive, Huffman-coded.
GPU_FRAMES = (0xC0, 0xC1, 0xC2)
LOSSLESS_FRAMES = (0xC3,)  # nvjpeg_lossless_decoder takes these, but never with a region (we always pass one)
ARITHMETIC_FRAMES = (0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF)  # no GPU decoder in nvImageCodec
HIERARCHICAL_FRAMES = (0xC5, 0xC6, 0xC7)  # differential frames: no decoder of nvImageCodec's

# Why a sample goes to the CPU path: the keys of ``stats.decoded_on_cpu_why``.
NOT_BYTES = "not bytes"
NOT_JPEG = "not a JPEG"
TRUNCATED = "no JPEG end marker at its end (truncated, or data after it)"
BAD_HEADER = "unreadable JPEG header"
LOSSLESS = "lossless JPEG"
ARITHMETIC = "arithmetic-coded JPEG"
HIERARCHICAL = "hierarchical JPEG"
NOT_8_BIT = "JPEG of more than 8 bits"
CMYK = "CMYK/YCCK JPEG"
RGB_CODED = "RGB-coded JPEG (no colour transform)"
OVER_BUDGET = "over the pixel budget"
REFUSED = "refused by nvImageCodec"
OUT_OF_MEMORY = "GPU out of memory"
GPU_ERROR = "GPU decode error"


class _BatchFields(NamedTuple):
    failures: dict[int, Exception]
    event: torch.cuda.Event | None
    on_cpu: list[int]


class BatchResult(_BatchFields):
    """``failures``: row -> the exception that row's bytes raised (its row in ``out`` is left as
    it was); ``event``: recorded on the stream after the last write (None off CUDA); ``on_cpu``:
    the rows the GPU left to the CPU path (fallbacks, for the loader's stats; not the CPU share).
    ``why`` (an attribute, not a fourth member: ``failures, event, on_cpu = decode_batch(...)``
    in a user's decoder that wraps this one keeps working): row of ``on_cpu`` -> the reason
    (``NOT_JPEG``, ``REFUSED``, ...)."""

    def __new__(cls, failures: dict[int, Exception], event: torch.cuda.Event | None, on_cpu: list[int],
                why: dict[int, str] | None = None) -> "BatchResult":
        result = super().__new__(cls, failures, event, on_cpu)
        result.why = {} if why is None else why
        return result

    def _replace(self, **changes: Any) -> "BatchResult":
        why = changes.pop("why", self.why)
        return BatchResult(*super()._replace(**changes), why=why)


class GpuImageDecoder:
    """A batch of encoded images -> ``out[i]`` = uint8 ``size x size x 3`` RGB on ``device``, the
    same transform as ``ImageDecoder(size, train, ...)`` (boxes, flips, torchvision's pixels within
    a level), decoded by nvImageCodec (only the crop's region) and resized and flipped on the GPU.

    The loader uses it by itself with ``device="cuda"`` and the default image decode
    (``AsyncLoader(gpu_decode="auto")``, see docs/guides/gpu-decode.md); this is the explicit form,
    e.g. ``AsyncLoader(source, decode=GpuImageDecoder(224, train=True), device="cuda")``. It runs
    in the loader's process (not in children).

    Args:
        size (int, default 224): the side of every output image.
        train (bool, default False): ``ImageDecoder``'s: False is Resize + CenterCrop, True is
            RandomResizedCrop + a random horizontal flip.
        scale ((float, float), default (0.08, 1.0)): with ``train``, the crop's area range.
        ratio ((float, float), default (3/4, 4/3)): with ``train``, the crop's aspect ratio range.
        flip (bool, default True): with ``train``, a horizontal flip with probability 1/2.
        seed (int, default 0): the seed of crops and flips, as ``ImageDecoder``'s: the same seed,
            epoch and sample give the same crop on either decoder.
        device (str or torch.device, default "cuda"): the GPU that decodes, where the images stay.
            ``"cpu"`` runs the same code through nvImageCodec's CPU backend into host memory (for
            tests and machines without CUDA).
        split ("auto", "gpu" or "cpu", default "auto"): in the loader, how each batch's rows are
            shared with the CPU decode threads (``split.py``): measured, all on the GPU, or all
            on the CPU (pinned, e.g. to compare).
        max_pixels (int or None, default 178,956,970, Pillow's limit): ``ImageDecoder``'s limit,
            checked from the header before the GPU sees the bytes: a JPEG over it goes to the CPU
            path (where a DCT reduction may bring it under, else ``ImageTooLarge``, alone); one
            GPU call decodes at most this many pixels (a batch of large images goes in several).
        decode_regions (callable, default nvImageCodec): ``(datas, regions, stream)`` -> a list of
            ``3 x H x W`` uint8 tensors (or None for a refused image); replace it to test failures.
    """

    batched = True  # the loader calls decode_batch once per batch share (pipeline/batched.py)

    def __init__(
        self,
        size: int = 224,
        train: bool = False,
        *,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        flip: bool = True,
        seed: int = 0,
        device: str | torch.device = "cuda",
        split: str = "auto",
        max_pixels: int | None = DEFAULT_MAX_PIXELS,
        decode_regions: RegionDecode | None = None,
    ) -> None:
        self.cpu = ImageDecoder(size, train, scale=scale, ratio=ratio, flip=flip, seed=seed, max_pixels=max_pixels)
        self.max_pixels = max_pixels
        self.size = size
        self.device = torch.device(device)
        self.policy = SplitPolicy(split)
        self._decode_regions = decode_regions
        self._held: tuple[torch.cuda.Event | None, list[Any]] | None = None  # the last batch's images
        self._lock = threading.Lock()  # one GPU call at a time: nvImageCodec's decoder and _held
        self._warned = False  # the warning that the GPU decodes nothing, given once

    @classmethod
    def like(cls, decoder: ImageDecoder, device: str | torch.device, split: str = "auto") -> "GpuImageDecoder":
        """The stage for ``decoder``'s transform (its size, train, crops, flips, seed, budget)."""
        return cls(decoder.size, decoder.train, scale=decoder.scale, ratio=decoder.ratio, flip=decoder.flip,
                   seed=decoder.seed, device=device, split=split, max_pixels=decoder.max_pixels)

    @property
    def field(self) -> Field:
        return self.cpu.field

    @property
    def decode_regions(self) -> RegionDecode:
        """nvImageCodec's batched region decode, made at first use (its import and decoder are slow)."""
        if self._decode_regions is None:
            from .nvimgcodec import RegionDecoder

            self._decode_regions = RegionDecoder(self.device)
        return self._decode_regions

    def __getstate__(self) -> dict[str, Any]:  # a copy starts with its own nvImageCodec decoder and lock
        state = dict(self.__dict__)
        state.update(_decode_regions=None, _held=None, _lock=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def decode_batch(
        self,
        datas: Sequence[bytes],
        keys: Sequence[Key],
        out: torch.Tensor,
        stream: torch.cuda.Stream | None = None,
        rows: Sequence[int] | None = None,
        cpu_share: bool = False,
    ) -> BatchResult:
        """Decodes ``datas[i]`` with the random choices of ``keys[i]`` into ``out[rows[i]]``
        (``out``: ``[B, size, size, 3]`` uint8 on ``device``; ``rows`` default: ``range``, a
        subset is e.g. the refill of failed rows), on ``stream`` (default: the current one).
        ``cpu_share``: the CPU path decodes every row (the loader's CPU share of a batch). Failures
        and ``on_cpu`` are numbered as ``datas``. Each call's rows and time feed ``policy``."""
        targets = [out[row] for row in (range(len(datas)) if rows is None else rows)]
        failures: dict[int, Exception] = {}
        on_cuda = self.device.type == "cuda"
        started = time.perf_counter()
        if cpu_share:
            with torch.cuda.stream(stream) if on_cuda else nullcontext():
                self._decode_on_cpu(datas, keys, targets, list(range(len(datas))), failures)
                event = _recorded() if on_cuda else None
            self.policy.cpu_done(len(datas), time.perf_counter() - started)
            return BatchResult(failures, event, [])
        gpu_rows, why, sizes = self.sort(datas, self.max_pixels)
        with self._lock, torch.cuda.stream(stream) if on_cuda else nullcontext():
            if gpu_rows:
                self.decode_regions  # noqa: B018 - made (a second or so, once) before the clock starts
            started = time.perf_counter()  # the GPU's time, not the wait for another batch's call
            if self._held is not None:
                # the last batch's images are freed only once the kernels that read them have run
                if self._held[0] is not None:
                    self._held[0].synchronize()
                self._held = None
            images: list[Any] = []
            for chunk in chunks(gpu_rows, {row: h * w for row, (h, w) in sizes.items()}, self.max_pixels):
                images += self._decode_on_device(datas, keys, targets, chunk, sizes, why, stream)
            event = _recorded() if on_cuda else None
            self._held = (event, images)
        if gpu_rows:
            self.policy.gpu_done(len(gpu_rows) - sum(row in why for row in gpu_rows), time.perf_counter() - started)
        cpu_rows = sorted(why)
        with torch.cuda.stream(stream) if on_cuda else nullcontext():
            self._decode_on_cpu(datas, keys, targets, cpu_rows, failures)
            if cpu_rows and on_cuda:
                event = _recorded()
        return BatchResult(failures, event, cpu_rows, why)

    def refused(self, datas: Sequence[bytes]) -> dict[int, str]:
        """The positions in ``datas`` the GPU would leave to the CPU path, from their headers
        alone (``sort``), each with its reason: the loader sends them to its CPU jobs at once."""
        return self.sort(datas, self.max_pixels)[1]

    @staticmethod
    def split_sized(datas: Sequence[bytes], max_pixels: int | None
                    ) -> tuple[list[int], list[int], dict[int, tuple[int, int]]]:
        """``sort`` with the CPU path's rows as a list, without their reasons."""
        gpu_rows, why, sizes = GpuImageDecoder.sort(datas, max_pixels)
        return gpu_rows, sorted(why), sizes

    @staticmethod
    def sort(datas: Sequence[bytes], max_pixels: int | None
             ) -> tuple[list[int], dict[int, str], dict[int, tuple[int, int]]]:
        """Rows the GPU may decode (``gpu_refusal`` finds nothing against them), the others
        with the reason (row -> reason), and the (height, width) of each JPEG from its header,
        all read before any GPU memory is taken."""
        gpu_rows, why, sizes = [], {}, {}
        for row, data in enumerate(datas):
            reason, size = gpu_refusal(data, max_pixels)
            if size is not None:
                sizes[row] = size
            if reason is None:
                gpu_rows.append(row)
            else:
                why[row] = reason
        return gpu_rows, why, sizes

    def region(self, height: int, width: int, key: Key) -> tuple[Plan, Box]:
        """The CPU path's choices for a ``height x width`` JPEG (its box snapped as there for a
        DCT-scaled decode, so both paths crop the same pixels; the decode here is full size) and
        the source region the transform reads: the box, or in eval the centre crop's lines."""
        rng = self.cpu.rng(key) if self.cpu.train else None  # eval draws nothing
        plan = self.cpu.plan(height, width, rng)
        return plan, plan.box if plan.box is not None else centre_crop_region(height, width, self.size)

    def _decode_on_device(self, datas: Sequence[bytes], keys: Sequence[Key], targets: list[torch.Tensor],
                          rows: list[int], sizes: dict[int, tuple[int, int]], why: dict[int, str],
                          stream: Any) -> list[Any]:
        """The GPU's rows, each written into its target; a row it refuses or fails on joins
        ``why`` with its reason (the CPU path decodes it). Returns the decoded images, to keep
        until their kernels have run.

        nvImageCodec reports a call that failed as a whole (an exception inside it, e.g. out of
        memory in nvJPEG's buffers) as None for every image (``Decoder::decode`` in its
        python/decoder.cpp), an image it refuses as None alone: a call of several images that
        raises or returns only None is retried one image at a time, after PyTorch's cached
        blocks are given back (nvImageCodec allocates outside PyTorch's caching allocator)."""
        plans = [self.region(*sizes[row], keys[row]) for row in rows]
        encoded = [datas[row] for row in rows]
        regions = [region for _, region in plans]
        reasons = [REFUSED] * len(rows)
        try:
            images = self.decode_regions(encoded, regions, stream)
        except Exception as error:  # one bad file (or out of memory) fails the whole call
            images, reasons = None, [_gpu_error(error)] * len(rows)
        failed_whole = (images is None or len(images) != len(rows)
                        or (len(rows) > 1 and all(image is None for image in images)))
        if failed_whole and images is not None and self._warned:
            # nvImageCodec has decoded nothing here, even alone (warned): no retry one by one, and no
            # empty_cache() each batch (it syncs the device and flushes the training step's blocks)
            images = [None] * len(rows)
        elif failed_whole:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            alone = [self._decode_alone(data, region, stream) for data, region in zip(encoded, regions)]
            images, reasons = [image for image, _ in alone], [reason for _, reason in alone]
            if len(rows) > 1 and all(image is None and reason == REFUSED for image, reason in alone) and not self._warned:
                self._warned = True  # once: every batch would say the same
                warnings.warn(f"nvImageCodec decoded none of {len(rows)} JPEGs on {self.device}, even one at a "
                              "time: they all go to the CPU path. Is its nvJPEG extension there (pip install "
                              "'nvidia-nvimgcodec-cu12[nvjpeg]', or -cu13 for CUDA 13)? PYNVIMGCODEC_VERBOSITY=3 "
                              "makes it say what it loads.", RuntimeWarning, stacklevel=2)
        for row, image, reason, (plan, region) in zip(rows, images, reasons, plans):
            if image is None:
                why[row] = reason
                continue
            try:
                targets[row].copy_(self.transform(image, plan, region, sizes[row]))
            except Exception as error:  # noqa: BLE001 - e.g. out of GPU memory: this row alone goes to the CPU
                why[row] = _gpu_error(error)
        return images

    def _decode_alone(self, data: bytes, region: Box, stream: Any) -> tuple[torch.Tensor | None, str]:
        """One image in a call of its own: (the image or None, the reason it is None)."""
        try:
            return self.decode_regions([data], [region], stream)[0], REFUSED
        except Exception as error:  # noqa: BLE001 - the CPU path decodes it, or raises the clear error
            return None, _gpu_error(error)

    def transform(self, image: torch.Tensor, plan: Plan, region: Box, source: tuple[int, int]) -> torch.Tensor:
        """A decoded ``region`` (3xHxW uint8) of a ``source`` (height, width) image -> size x size
        x 3: the box resized (``plan.box``), or in eval torchvision's Resize + CenterCrop of the
        whole image computed from the region's lines; then the flip; on the image's device."""
        if tuple(image.shape[1:]) != tuple(region[2:]):
            raise RuntimeError(f"decoded {tuple(image.shape[1:])}, not the region {region[2:]}")
        if plan.box is None:
            resized = centre_crop_of_region(image, region[:2], source, self.size)
        else:
            resized = resize_aa(image, (self.size, self.size))
        if plan.flip:
            resized = resized.flip(2)
        return resized.permute(1, 2, 0)

    def _decode_on_cpu(self, datas: Sequence[bytes], keys: Sequence[Key], targets: list[torch.Tensor],
                       rows: list[int], failures: dict[int, Exception]) -> None:
        """``rows`` through ImageDecoder: into the targets on the host, else into pinned staging
        rows of this call's own (the host allocator keeps them until their copies have run), each
        copied up."""
        if not rows:
            return
        device = targets[0].device
        staging = None
        if device.type != "cpu":
            staging = torch.empty((len(rows), *self.field.shape), dtype=torch.uint8,
                                  pin_memory=device.type == "cuda")
        for number, row in enumerate(sorted(rows)):
            host = targets[row] if staging is None else staging[number]
            try:
                self.cpu.decode_into(datas[row], host.numpy(), keys[row])
            except Exception as error:  # noqa: BLE001 - reported per row, as the loader does
                failures[row] = error
                continue
            if staging is not None:
                targets[row].copy_(host, non_blocking=True)


def gpu_refusal(data: Any, max_pixels: int | None) -> tuple[str | None, tuple[int, int] | None]:
    """Why the GPU decoder would refuse ``data`` (None if it would not), from the header alone,
    and the (height, width) the header gives (None if it gives none).

    Refused: anything but bytes, not a JPEG, a JPEG not ending with its EOI marker (truncated:
    the GPU might decode what is there without a word, while the strict CPU path raises the clear
    error), a header libjpeg cannot read, a frame nvImageCodec has no GPU decoder for with a
    region (lossless, arithmetic-coded, hierarchical, more than 8 bits a sample; read from the
    SOF marker, ``jpeg_frame``), CMYK/YCCK (nvJPEG converts those otherwise than the CPU path)
    and RGB-coded JPEGs (``GPU_COLOURSPACES``),
    more pixels than ``max_pixels`` at full size (the CPU path may decode it reduced, else
    raises the clear error)."""
    if not isinstance(data, (bytes, bytearray, memoryview, np.ndarray)):  # a dict: the CPU path names it
        return NOT_BYTES, None
    if bytes(data[:3]) != JPEG_MAGIC:
        return NOT_JPEG, None
    if not bytes(data[-16:]).rstrip(b"\0").endswith(JPEG_END):
        return TRUNCATED, None
    frame = jpeg_frame(data)
    if frame is None:
        return BAD_HEADER, None
    marker, precision = frame  # before libjpeg reads it: a build without lossless or 12 bits refuses those
    if marker in LOSSLESS_FRAMES:
        return LOSSLESS, None
    if marker in ARITHMETIC_FRAMES:
        return ARITHMETIC, None
    if marker not in GPU_FRAMES:
        return HIERARCHICAL, None
    if precision != 8:
        return NOT_8_BIT, None
    try:
        height, width, colourspace, _ = simplejpeg.decode_jpeg_header(data)
    except Exception:  # a header libjpeg rejects: the CPU path raises the clear error
        return BAD_HEADER, None
    if colourspace not in GPU_COLOURSPACES:
        return (RGB_CODED if colourspace == "RGB" else CMYK), (height, width)
    if max_pixels is not None and height * width > max_pixels:
        return OVER_BUDGET, (height, width)
    return None, (height, width)


SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # not DHT, JPG, DAC


def jpeg_frame(data: Any) -> tuple[int, int] | None:
    """(SOF marker, sample precision) of a JPEG's frame header, found by walking its marker
    segments from SOI (a few steps: APPn, DQT, DHT, then the frame); None if the scan or the
    end comes first, or the segments do not chain (a broken header)."""
    view = memoryview(data).cast("B") if not isinstance(data, (bytes, bytearray)) else data
    at, size = 2, len(view)
    while at + 4 < size:
        if view[at] != 0xFF:
            return None
        marker = view[at + 1]
        if marker == 0xFF:  # a fill byte
            at += 1
            continue
        if marker in (0xDA, 0xD9):  # the scan or the end before any frame
            return None
        if marker in SOF_MARKERS:
            return marker, view[at + 4]
        at += 2 + ((view[at + 2] << 8) | view[at + 3])
    return None


def _gpu_error(error: BaseException) -> str:
    """The reason a GPU call or kernel failed, for the stats: out of memory, or another error."""
    if isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower():
        return OUT_OF_MEMORY
    return GPU_ERROR


def _recorded() -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record()
    return event


def check_gpu_decode(gpu_decode: Any) -> None:
    """Only a real bool or "auto": ``0 in (True, False, "auto")`` is true, and a 0 or 1 taken
    for "off" would turn the stage on."""
    if not (type(gpu_decode) is bool or (type(gpu_decode) is str and gpu_decode == "auto")):
        raise ValueError(f"gpu_decode must be 'auto', True or False, got {gpu_decode!r}")


def decode_stage(decode: Any, device: torch.device | None, gpu_decode: bool | str, processes: int) -> Any:
    """The decode the loader runs: with ``device`` on CUDA and the default image decode
    (``ImageDecoder``, antialiased, train or not), the GPU stage (``GpuImageDecoder.like``)
    unless ``gpu_decode`` is False; ``True`` pins every row on the GPU, ``"auto"`` shares each
    batch with the CPU threads by measuring. The stage runs in this process: with ``processes``
    (children), ``"auto"`` leaves the decode to them and ``True`` is an error. Anything else is
    returned as it is, so a loader without CUDA costs nothing more."""
    check_gpu_decode(gpu_decode)
    if gpu_decode is False or type(decode) is not ImageDecoder or not decode.antialias:
        if gpu_decode is True and not isinstance(decode, GpuImageDecoder):
            raise ValueError("gpu_decode=True needs the default image decode (ImageDecoder, antialias=True): "
                             f"got decode={type(decode).__name__}")
        return decode
    if device is None or device.type != "cuda":
        if gpu_decode is True:
            raise ValueError("gpu_decode=True needs device='cuda' (the stage writes the batches there)")
        return decode
    if processes:
        if gpu_decode is True:
            raise ValueError("gpu_decode=True runs in this process: it cannot be used with processes=N or isolate=True")
        return decode
    from .nvimgcodec import available

    if not available():
        if gpu_decode is True:
            from .nvimgcodec import load

            load()  # raises the ImportError saying what to install
        return decode
    return GpuImageDecoder.like(decode, device, split="gpu" if gpu_decode is True else "auto")


def chunks(rows: list[int], pixels: dict[int, int], max_pixels: int | None) -> list[list[int]]:
    """``rows`` in order, cut into runs of at most ``max_pixels`` decoded pixels (or one row):
    the bound of one nvJPEG call's output."""
    if max_pixels is None:
        return [rows] if rows else []
    runs, run, total = [], [], 0
    for row in rows:
        if run and total + pixels[row] > max_pixels:
            runs.append(run)
            run, total = [], 0
        run.append(row)
        total += pixels[row]
    return runs + [run] if run else runs
