"""The per-sample work every contender does: the same reads, the same decode, the same arrays.

Only the machinery around these functions differs between contenders, which is the point of the
comparison. Everything here is picklable or rebuilt per process, so DataLoader workers can use it.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

import numpy as np

from bench.harness.workloads import LARGE_IO_S, LARGE_SHAPE

# s3fs sends a HEAD before each GET unless told the object is read in one request; every contender
# gets the same courtesy (asyncload's own reader does this too).
S3_READ_KWARGS = {"max_concurrency": 1}

_fs_cache: dict[tuple[int, str], Any] = {}
_fs_lock = threading.Lock()


def s3_options(endpoint_url: str, pool: int = 10) -> dict:
    """s3fs options for the local server; `pool` HTTP connections, which threaded readers need
    raised from botocore's 10 so that connections do not cap their concurrency."""
    from tests.support.s3server import storage_options

    return {**storage_options(endpoint_url), "config_kwargs": {"max_pool_connections": pool}}


def sync_s3(options: dict):
    """A synchronous s3fs filesystem, one per process (a forked worker must not reuse its parent's
    HTTP session)."""
    import s3fs

    key = (os.getpid(), repr(sorted(options.items())))
    with _fs_lock:  # 16 reader threads arriving at once must not build 16 clients
        if key not in _fs_cache:
            _fs_cache[key] = s3fs.S3FileSystem(skip_instance_cache=True, **options)
        return _fs_cache[key]


def read_bytes(url: str, options: dict | None) -> bytes:
    """The object's bytes: a plain file read locally, one GET on S3."""
    if url.startswith("s3://"):
        return sync_s3(options or {}).cat_file(url, **S3_READ_KWARGS)
    with open(url, "rb") as file:
        return file.read()


_decoders: dict[int, Any] = {}


def image_decoder(seed: int = 0):
    """asyncload's ImageDecoder with training transforms (random-resized-crop 224 + flip), one per
    process, so every contender decodes with the very same code."""
    from asyncload import ImageDecoder

    pid = os.getpid()
    if pid not in _decoders:
        _decoders[pid] = ImageDecoder(size=224, train=True, seed=seed)
    return _decoders[pid]


def load_image(item: tuple[str, int], options: dict | None) -> tuple[np.ndarray, int]:
    """Read + decode + transform one (url, label) item: the DataLoader / torchdata sample."""
    url, label = item
    return image_decoder()(read_bytes(url, options)), label


_BANK = None


def _bank() -> np.ndarray:
    """Random rows that the large samples are copied from: real memory traffic, no RNG cost."""
    global _BANK
    if _BANK is None:
        rows = LARGE_SHAPE[0] * 2
        _BANK = np.random.default_rng(0).random((rows, LARGE_SHAPE[1]))
    return _BANK


def large_array(index: int) -> np.ndarray:
    """A fresh (1000, 150) float64 array for sample `index` (a copied slice of the bank)."""
    start = (index * 7) % LARGE_SHAPE[0]
    return _bank()[start : start + LARGE_SHAPE[0]].copy()


def large_read_sync(index: int) -> int:
    """The large sample's I/O: 3.125 ms of waiting, GIL released."""
    time.sleep(LARGE_IO_S)
    return index


async def large_read_async(index: int) -> int:
    """The same wait as an asyncio sleep, for loaders that await their reads."""
    await asyncio.sleep(LARGE_IO_S)
    return index


def load_large(index: int) -> np.ndarray:
    """Wait + make the array: the DataLoader / torchdata sample."""
    return large_array(large_read_sync(index))
