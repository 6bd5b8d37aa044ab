"""asyncload: a PyTorch data loader that never pickles a sample: reads on an event loop,
decode on threads that release the GIL, and child processes only when one GIL is the limit.

Names are imported on first use, so ``import asyncload`` stays cheap (PyTorch alone takes over
a second to import).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_PUBLIC = {
    "AsyncLoader": "asyncload.loader",
    "SampleError": "asyncload.errors",
    "TooManyFailures": "asyncload.errors",
    "StorageError": "asyncload.errors",
    "ImageDecoder": "asyncload.decode.image",
    "GpuImageDecoder": "asyncload.decode.gpu",
    "ImageTooLarge": "asyncload.decode.budget",
    "Source": "asyncload.sources.items",
    "image_folder": "asyncload.sources.items",
    "list_files": "asyncload.sources.items",
    "manifest": "asyncload.sources.items",
    "mix": "asyncload.sources.mix",
    "MixedSource": "asyncload.sources.mix",
    "tar_shards": "asyncload.sources.shards",
    "write_shards": "asyncload.sources.writer",
    "index_shards": "asyncload.sources.writer",
    "parquet": "asyncload.sources.parquet",
    "write_parquet": "asyncload.sources.writer",
    "mds": "asyncload.sources.mds",
    "litdata": "asyncload.sources.litdata",
    "Members": "asyncload.decode.members",
}

__all__ = sorted(_PUBLIC)

if TYPE_CHECKING:
    from .decode.budget import ImageTooLarge
    from .decode.gpu import GpuImageDecoder
    from .decode.image import ImageDecoder
    from .decode.members import Members
    from .errors import SampleError, StorageError, TooManyFailures
    from .loader import AsyncLoader
    from .sources.items import Source, image_folder, list_files, manifest
    from .sources.litdata import litdata
    from .sources.mds import mds
    from .sources.mix import mix
    from .sources.mix import MixedSource
    from .sources.parquet import parquet
    from .sources.writer import write_parquet
    from .sources.shards import tar_shards
    from .sources.writer import index_shards, write_shards


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'asyncload' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
