"""A batch of JPEGs decoded on the GPU (nvJPEG, through torchvision) and cropped/resized there.

Past what the CPU cores can decode (measured by the team: nvJPEG + antialiased resize 9,113 img/s
at batch 256 on an H100, 1.5x sixteen cores), the decode moves to the GPU and the CPU stays free
for the rest of the training step. The crop boxes and flips are ``ImageDecoder``'s, from the same
``(seed, key)``, so switching between the two paths keeps the augmentation stream. What nvJPEG
does not decode (CMYK/YCCK JPEGs, any other format, a JPEG it rejects) goes through the CPU path
into a pinned staging row and is copied up, so a batch never fails for its format. So does a JPEG
whose full size is over the decode limit (``budget.py``: nvJPEG cannot decode it reduced), and one
the GPU fails on (a CUDA out-of-memory included), alone: one image never fails the batch.

Streams: torchvision decodes on a stream of its own and makes the *current* stream wait for it, so
everything here (decode, resize, copies) runs inside ``torch.cuda.stream(stream)``; the returned
event marks its end, for the consumer's stream to wait on (never the host). Its outputs are
allocated on the current stream but written on its own, so a batch first waits (on the host, on the
thread that calls it) for the previous batch's kernels, whose freed memory nvJPEG could reuse. The caller must not hand ``out`` to us while another stream
may still read it: make ``stream`` wait on the event that released it first.
"""

from __future__ import annotations

import threading
import warnings
from contextlib import nullcontext
from typing import Callable, NamedTuple, Sequence

import numpy as np
import simplejpeg
import torch

from ..batch.layout import Field
from .budget import DEFAULT_MAX_PIXELS
from .image import JPEG_MAGIC, ImageDecoder, Plan
from .resize import WHOLE_RESIZE_LIMIT, centre_crop_lines, centre_crop_offsets, resize_aa, resized_shape

Key = tuple[int, ...] | None
JpegBatchDecode = Callable[[list[torch.Tensor], torch.device], list[torch.Tensor]]
JPEG_END = b"\xff\xd9"  # the EOI marker: a JPEG without it at its end is truncated
NVJPEG_COLOURSPACES = ("RGB", "YCbCr", "Gray")  # simplejpeg's names; CMYK and YCCK go to the CPU


def torchvision_decode_jpegs(datas: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """torchvision's batched ``decode_jpeg`` (nvJPEG on a CUDA device): 3xHxW uint8 RGB each."""
    from torchvision.io import ImageReadMode, decode_jpeg

    return decode_jpeg(datas, mode=ImageReadMode.RGB, device=device)


class BatchResult(NamedTuple):
    """``failures``: row -> the exception that row's bytes raised (its row in ``out`` is left as
    it was); ``event``: recorded on the stream after the last write (None off CUDA); ``on_cpu``:
    the rows decoded by the CPU path (for the loader's stats: many means the GPU path is idle)."""

    failures: dict[int, Exception]
    event: torch.cuda.Event | None
    on_cpu: list[int]


class GpuImageDecoder:
    """A batch of encoded images -> ``out[i]`` = uint8 ``size x size x 3`` RGB on ``device``, the
    same transform as ``ImageDecoder(size, train, ...)`` (boxes, flips, torchvision's pixels),
    decoded by nvJPEG (torchvision's batched ``decode_jpeg``) and cropped, resized and flipped on
    the GPU. What nvJPEG does not decode (CMYK JPEGs, PNG, other formats) goes through
    ``ImageDecoder`` on the CPU and is copied up. Use it as
    ``AsyncLoader(source, decode=GpuImageDecoder(224, train=True), device="cuda")``: a CUDA
    decoder needs the same ``device`` on the loader, and it runs in-process (not with
    ``processes``).

    Args:
        size (int, default 224): the side of every output image.
        train (bool, default False): ``ImageDecoder``'s: False is Resize + CenterCrop, True is
            RandomResizedCrop + a random horizontal flip.
        scale ((float, float), default (0.08, 1.0)): with ``train``, the crop's area range, as
            ``ImageDecoder``'s.
        ratio ((float, float), default (3/4, 4/3)): with ``train``, the crop's aspect ratio range.
        flip (bool, default True): with ``train``, a horizontal flip with probability 1/2.
        seed (int, default 0): the seed of crops and flips, as ``ImageDecoder``'s: the same seed,
            epoch and sample give the same crop on either decoder.
        device (str or torch.device, default "cuda"): the GPU that decodes, where the images stay.
            ``"cpu"`` runs the same code on the CPU into host memory (for tests without a GPU).
        decode_jpegs (callable, default torchvision's batched ``decode_jpeg``): a list of 1-D
            uint8 tensors of JPEG bytes and a device -> a list of ``3 x H x W`` uint8 RGB tensors;
            replace it to test without torchvision or to use another batched decoder.
        max_pixels (int or None, default 178,956,970, Pillow's limit): ``ImageDecoder``'s limit,
            checked from the header before nvJPEG sees the bytes. nvJPEG decodes at full size: a
            JPEG over the limit goes to the CPU path, where a DCT reduction may bring it under
            (else it fails alone, ``ImageTooLarge``); one nvJPEG call decodes at most this many
            pixels (a batch of large images goes in several calls). An image nvJPEG fails on
            (a CUDA out-of-memory included) is retried alone, then decoded on the CPU.
    """

    batched = True  # the loader calls decode_batch once per batch (pipeline/batched.py), not decode_into per row

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
        decode_jpegs: JpegBatchDecode = torchvision_decode_jpegs,
        max_pixels: int | None = DEFAULT_MAX_PIXELS,
    ) -> None:
        self.cpu = ImageDecoder(size, train, scale=scale, ratio=ratio, flip=flip, seed=seed, max_pixels=max_pixels)
        self.max_pixels = max_pixels
        self.size = size
        self.device = torch.device(device)
        self.decode_jpegs = decode_jpegs
        self._staging: torch.Tensor | None = None  # pinned rows for the CPU fallback
        self._staging_free: torch.cuda.Event | None = None
        self._last_batch: torch.cuda.Event | None = None  # the end of the previous decode_batch
        self._lock = threading.Lock()  # one batch at a time: the staging rows are shared

    @property
    def field(self) -> Field:
        return self.cpu.field

    def decode_batch(
        self,
        datas: Sequence[bytes],
        keys: Sequence[Key],
        out: torch.Tensor,
        stream: torch.cuda.Stream | None = None,
        rows: Sequence[int] | None = None,
    ) -> BatchResult:
        """Decodes ``datas[i]`` with the random choices of ``keys[i]`` into ``out[rows[i]]``
        (``out``: ``[B, size, size, 3]`` uint8 on ``device``; ``rows`` default: ``range``, a
        subset is e.g. the refill of failed rows), on ``stream`` (default: the current one).
        Failures and ``on_cpu`` are numbered as ``datas``."""
        targets = [out[row] for row in (range(len(datas)) if rows is None else rows)]
        failures: dict[int, Exception] = {}
        gpu_rows, cpu_rows, pixels = self.split_sized(datas, self.max_pixels)
        with self._lock, torch.cuda.stream(stream) if self.device.type == "cuda" else nullcontext():
            for chunk in chunks(gpu_rows, pixels, self.max_pixels):
                self._decode_on_device(datas, keys, targets, chunk, cpu_rows)
            self._decode_on_cpu(datas, keys, targets, cpu_rows, failures)
            event = None
            if self.device.type == "cuda":
                event = torch.cuda.Event()
                event.record()
                self._last_batch = event
        return BatchResult(failures, event, sorted(cpu_rows))

    @staticmethod
    def split_sized(datas: Sequence[bytes], max_pixels: int | None) -> tuple[list[int], list[int], dict[int, int]]:
        """Rows nvJPEG can decode (baseline/progressive YCbCr or grey JPEGs, within
        ``max_pixels``), the others, and the pixels of each nvJPEG row (from its header). A JPEG
        that does not end with its EOI marker is truncated: nvJPEG may decode what is there
        without a word, so it goes to the CPU path, whose strict libjpeg raises the clear error."""
        gpu_rows, cpu_rows, pixels = [], [], {}
        for row, data in enumerate(datas):
            if not isinstance(data, (bytes, bytearray, memoryview, np.ndarray)):  # a dict: the CPU path names it
                cpu_rows.append(row)
                continue
            if bytes(data[:3]) != JPEG_MAGIC or not bytes(data[-16:]).rstrip(b"\0").endswith(JPEG_END):
                cpu_rows.append(row)
                continue
            try:
                height, width, colourspace, _ = simplejpeg.decode_jpeg_header(data)
            except Exception:  # a header libjpeg rejects: the CPU path raises the clear error
                cpu_rows.append(row)
                continue
            # over the limit at full size: the CPU path decodes it reduced, or raises the clear error
            within = max_pixels is None or height * width <= max_pixels
            (gpu_rows if colourspace in NVJPEG_COLOURSPACES and within else cpu_rows).append(row)
            pixels[row] = height * width
        return gpu_rows, cpu_rows, pixels

    def _decode_on_device(self, datas: Sequence[bytes], keys: Sequence[Key], targets: list[torch.Tensor],
                          rows: list[int], cpu_rows: list[int]) -> None:
        """nvJPEG's rows; a row it rejects joins ``cpu_rows``."""
        if not rows:
            return
        if self._last_batch is not None:
            # torchvision allocates its outputs on the current stream but writes them on a
            # stream of its own, ordered after nothing of ours: memory our last batch's kernels
            # freed while still queued could be overwritten under them. Waiting for that batch
            # (a host wait on this decode thread, never on the training loop) closes the gap.
            self._last_batch.synchronize()
        with warnings.catch_warnings():  # the bytes are only read: a read-only buffer is fine
            warnings.simplefilter("ignore", UserWarning)
            encoded = [torch.frombuffer(datas[row], dtype=torch.uint8) for row in rows]
        try:
            images = self.decode_jpegs(encoded, self.device)
        except Exception:  # one bad file (or a CUDA out-of-memory) fails the whole call: retry alone, then the CPU
            images = None
        if images is None or len(images) != len(rows):
            images = [self._decode_alone(data) for data in encoded]
        for number, (row, image) in enumerate(zip(rows, images)):
            images[number] = None  # each decoded image freed as soon as it is written
            try:
                if image is None:
                    raise RuntimeError("nvJPEG failed")
                # the CPU path's box, snapped as there for a DCT-scaled decode, so that both paths
                # crop the same pixels; the decode here is full size (plan.reduce is unused)
                rng = self.cpu.rng(keys[row]) if self.cpu.train else None  # eval draws nothing
                plan = self.cpu.plan(int(image.shape[1]), int(image.shape[2]), rng)
                targets[row].copy_(self.transform(image, plan))
            except Exception:  # noqa: BLE001 - e.g. out of GPU memory: this row alone goes to the CPU
                cpu_rows.append(row)

    def _decode_alone(self, data: torch.Tensor) -> torch.Tensor | None:
        try:
            return self.decode_jpegs([data], self.device)[0]
        except Exception:  # noqa: BLE001 - the CPU path decodes it, or raises the clear error
            return None

    def transform(self, image: torch.Tensor, plan: Plan) -> torch.Tensor:
        """3xHxW uint8 -> size x size x 3: torchvision's Resize + CenterCrop (``plan.box`` None)
        or crop + resize, then the flip; on the image's device."""
        if plan.box is None:
            new_h, new_w = resized_shape(int(image.shape[1]), int(image.shape[2]), self.size)
            top, left = centre_crop_offsets(new_h, new_w, self.size)
            if max(new_h, new_w) > WHOLE_RESIZE_LIMIT * self.size:  # a thin image: the crop's lines only
                resized = centre_crop_lines(image, new_h, new_w, self.size)
            else:
                resized = resize_aa(image, (new_h, new_w))[:, top : top + self.size, left : left + self.size]
        else:
            top, left, height, width = plan.box
            resized = resize_aa(image[:, top : top + height, left : left + width], (self.size, self.size))
        if plan.flip:
            resized = resized.flip(2)
        return resized.permute(1, 2, 0)

    def _decode_on_cpu(self, datas: Sequence[bytes], keys: Sequence[Key], targets: list[torch.Tensor],
                       rows: list[int], failures: dict[int, Exception]) -> None:
        """The rows nvJPEG left: ImageDecoder into pinned staging rows, then one copy up each."""
        if not rows:
            return
        on_host = targets[0].device.type == "cpu"
        staging = None if on_host else self._staging_rows(len(datas), targets[0].device.type == "cuda")
        for row in sorted(rows):
            host = targets[row] if staging is None else staging[row]
            try:
                self.cpu.decode_into(datas[row], host.numpy(), keys[row])
            except Exception as error:  # noqa: BLE001 - reported per row, as the loader does
                failures[row] = error
                continue
            if staging is not None:
                targets[row].copy_(host, non_blocking=True)
        if targets[0].device.type == "cuda":
            self._staging_free = torch.cuda.Event()
            self._staging_free.record()

    def _staging_rows(self, rows: int, pin: bool) -> torch.Tensor:
        if self._staging_free is not None:
            self._staging_free.synchronize()  # the last batch's copies have read the rows
        if self._staging is None or self._staging.shape[0] < rows:
            shape = (rows, *self.field.shape)
            self._staging = torch.empty(shape, dtype=torch.uint8, pin_memory=pin and torch.cuda.is_available())
        return self._staging


def jpeg_decode_on_cpu(datas: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """A batched JPEG decode with simplejpeg (strict, as the CPU path), 3xHxW on ``device``: the
    stand-in for nvJPEG where torchvision is absent, and a reference for it."""
    images = [simplejpeg.decode_jpeg(np.asarray(data), colorspace="RGB", strict=True) for data in datas]
    return [torch.from_numpy(image).permute(2, 0, 1).to(device) for image in images]


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
