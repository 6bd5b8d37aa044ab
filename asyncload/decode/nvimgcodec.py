"""nvImageCodec, the GPU JPEG decoder: regions of a batch of JPEGs in one call, as torch tensors.

Why nvImageCodec (``nvidia-nvimgcodec-cu12`` / ``-cu13``): one batched call decodes a whole
batch with the GIL released, only the region asked for (the random crop's box: the rest of an
ImageNet photo is never decoded), on the GPU's hardware JPEG engines where it has them (A100,
H100, H200; they take no SM from the training step), else nvJPEG's CUDA decode; and its CPU
backend (libjpeg-turbo) runs the very same calls on a machine without CUDA, which is how the tests
run the stage. torchvision's ``decode_jpeg(device="cuda")``, used before, decodes whole images
and is deprecated.

Its import is noisy on a machine without the CUDA libraries: every extension it cannot load
(nvJPEG, nvJPEG2000, nvTIFF) prints a paragraph on standard error, at import and at each new
decoder. Without CUDA, ``load()`` points it at the CPU extensions alone (a private folder of
links) and turns its log down: what it refuses comes back as ``None`` and goes to the CPU path,
counted, so its own messages add nothing. nvImageCodec takes both settings from environment
variables (``NVIMGCODEC_EXTENSIONS_PATH``, ``PYNVIMGCODEC_VERBOSITY``), read once, when its
import creates the library's instance (``Module::Module`` and ``PluginFramework`` in its
source), which also loads every extension then: so they are set only around that import, under
a lock, and put back as they were right after it (the folder of links removed too); one the
user set is never touched. Nothing else in the process sees them afterwards.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from .geometry import Box

CPU_EXTENSIONS = ("libjpeg_turbo_ext", "libopencv_ext", "libnvbmp_ext", "libnvpnm_ext", "libtiff_ext")
_lock = threading.Lock()


def _extensions_dir() -> Path | None:
    """The wheel's ``extensions`` folder, found without importing it (the import is what prints)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("nvidia.nvimgcodec")
    except ImportError:  # no ``nvidia`` package at all (find_spec imports the parent): the import says what to install
        return None
    if spec is None or spec.origin is None:
        return None
    folder = Path(spec.origin).parent / "extensions"
    return folder if folder.is_dir() else None


def _cpu_extensions_only() -> Path | None:
    """A private temporary folder of links to nvImageCodec's CPU extensions alone (None if its
    ``extensions`` folder is not found): what ``NVIMGCODEC_EXTENSIONS_PATH`` points at for the
    import without CUDA."""
    folder = _extensions_dir()
    if folder is None:
        return None
    private = Path(tempfile.mkdtemp(prefix="asyncload-nvimgcodec-"))
    for path in folder.iterdir():
        if path.name.split(".so")[0] in CPU_EXTENSIONS:
            (private / path.name).symlink_to(path)
    return private


@contextmanager
def _environment(settings: dict[str, str]) -> Iterator[None]:
    """``settings`` in ``os.environ`` for the ``with`` block only, each one the user has not set
    already (theirs wins); what was absent is removed again after it."""
    added = [name for name in settings if name not in os.environ]
    for name in added:
        os.environ[name] = settings[name]
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


@cache
def load() -> Any:
    """The ``nvidia.nvimgcodec`` module, imported quietly (see the module's docstring); raises
    ``ImportError`` saying what to install when it is missing or does not load."""
    with _lock:
        settings: dict[str, str] = {}
        private = None
        if not torch.cuda.is_available():
            if "NVIMGCODEC_EXTENSIONS_PATH" not in os.environ:
                private = _cpu_extensions_only()
            if private is not None:
                settings["NVIMGCODEC_EXTENSIONS_PATH"] = str(private)
            settings["PYNVIMGCODEC_VERBOSITY"] = "0"
        try:
            with _environment(settings):
                from nvidia import nvimgcodec
        except Exception as error:  # absent, or a build that does not load here (another CUDA)
            raise ImportError("GPU decode needs nvImageCodec: pip install 'asyncload[gpu]' (nvidia-nvimgcodec-cu12), "
                              "or nvidia-nvimgcodec-cu13 for CUDA 13") from error
        finally:
            if private is not None:  # its extensions are loaded by now (dlopen): the links are not needed
                shutil.rmtree(private, ignore_errors=True)
    return nvimgcodec


def gpu_backends(codec: Any) -> list[Any]:
    """The backends of the CUDA decoder: nvJPEG's hardware engines (``HW_GPU_ONLY``, where the
    GPU has them; what they refuse, e.g. a progressive JPEG, moves on) and its CUDA decoder
    (which nvImageCodec files as ``HYBRID_CPU_GPU``: Huffman decoding of small images on CPU
    threads, the rest on the GPU). Not its CPU backends: left to its defaults (all backends) it
    would decode what the GPU refuses with libjpeg-turbo on threads of its own, inside the GPU
    call, unseen by the split and by the stats; without them such an image comes back None and
    goes to the loader's CPU path, counted."""
    return [codec.Backend(codec.HW_GPU_ONLY), codec.Backend(codec.HYBRID_CPU_GPU)]


def available() -> bool:
    """Whether nvImageCodec imports here."""
    try:
        load()
    except ImportError:
        return False
    return True


class RegionDecoder:
    """Batched region decode with nvImageCodec: ``decoder(datas, regions, stream)`` -> for each
    JPEG its region (``(top, left, height, width)`` in source pixels, None for the whole image) as
    a ``3 x height x width`` uint8 RGB tensor on ``device``, or None where nvImageCodec could not
    decode it (the caller sends that one to the CPU path).

    On a CUDA device the GPU backends alone decode (``gpu_backends``), ordered on ``stream``:
    nvImageCodec makes the stream passed as ``cuda_stream`` wait for its own streams' work before
    ``decode`` returns, and allocates each image there (``cudaMallocAsync``; freed with
    ``cudaFreeAsync`` on that stream when the image goes). The tensors wrap that memory through
    ``__cuda_array_interface__``: ``torch.as_tensor`` keeps a reference to the image (the memory
    lives as long as the tensor) and ignores the interface's ``stream``, which is harmless here
    because every kernel that reads the image is queued on that same stream. On the CPU, its CPU
    backend (libjpeg-turbo) decodes into host memory with ``cpu_threads`` threads of its own: the
    same calls, for tests and machines without CUDA."""

    def __init__(self, device: torch.device, cpu_threads: int = 1) -> None:
        codec = load()
        self.codec = codec
        self.device = device
        self.params = codec.DecodeParams(color_spec=codec.ColorSpec.SRGB, apply_exif_orientation=False)
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            self.decoder = codec.Decoder(device_id=index, backends=gpu_backends(codec))
        else:
            self.decoder = codec.Decoder(device_id=codec.NVIMGCODEC_DEVICE_CPU_ONLY,
                                         backends=[codec.Backend(codec.CPU_ONLY)], max_num_cpu_threads=cpu_threads)

    def __call__(self, datas: Sequence[bytes], regions: Sequence[Box | None],
                 stream: torch.cuda.Stream | None = None) -> list[torch.Tensor | None]:
        codec = self.codec
        streams = []
        for data, region in zip(datas, regions):
            stream_ = codec.CodeStream(bytes(data))
            if region is not None:
                top, left, height, width = region
                stream_ = stream_.get_sub_code_stream(region=codec.Region(top, left, top + height, left + width))
            streams.append(stream_)
        if self.device.type == "cuda":
            handle = (stream or torch.cuda.current_stream(self.device)).cuda_stream
            images = self.decoder.decode(streams, params=self.params, cuda_stream=handle)
            return [None if image is None else torch.as_tensor(image, device=self.device).permute(2, 0, 1)
                    for image in images]
        images = self.decoder.decode(streams, params=self.params)
        return [None if image is None else torch.from_numpy(_host_array(image)).permute(2, 0, 1) for image in images]


def _host_array(image: Any) -> np.ndarray:
    """A host image as HxWx3 uint8 (a grey or 4-channel result made RGB, should one come)."""
    array = np.asarray(image.cpu())
    if array.ndim == 2:
        array = array[:, :, None]
    if array.shape[2] == 1:  # an SRGB decode gives 3 channels; a grey one would be expanded here
        array = np.repeat(array, 3, axis=2)
    return array[:, :, :3]
