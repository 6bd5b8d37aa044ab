"""The item cache as the pipeline uses it: which items of a source (an ``image_folder``,
``list_files`` or ``manifest`` with ``cache_dir``, alone or mixed) are read through a disk cache
(``io/cache_items.py``), and closing those caches with the run. Here, not in ``io/``: knowing the
sources is the pipeline's business, and ``io/`` stays below them.
"""

from __future__ import annotations

from typing import Any, Callable

from ..io.cache_items import ItemCache
from ..sources.items import Source
from ..sources.mix_source import MixedSource


def item_cache(source: Any, reader: Any) -> Callable[[Any, int], Any] | None:
    """How the pipeline reads an item of ``source`` through the disk cache: ``read(key, index)``
    (an awaitable, or None for an item not cached: a local file, no ``cache_dir``), or None when
    no part of the source has a ``cache_dir``. A mix's parts each keep their own cache."""
    if isinstance(source, Source):
        parts, locate = [source], lambda index: (source, index)
    elif isinstance(source, MixedSource) and all(isinstance(p, Source) for p in source.sources):
        parts, locate = list(source.sources), lambda index: source.locate(index)[:2]
    else:
        return None
    caches = {id(p): ItemCache(p.cache_dir, p.cache_bytes, reader, p.listed if p.has_listing else None)
              for p in parts if getattr(p, "cache_dir", None) is not None}
    if not caches:
        return None

    def read(key: Any, index: int) -> Any:
        part, local = locate(index)
        cache = caches.get(id(part))
        if cache is None or not isinstance(key, str) or reader.is_local(key):
            return None
        return cache.read(key, local)

    read.caches = list(caches.values())  # type: ignore[attr-defined]
    return read


async def close(read: Any) -> None:
    """Cancels the downloads of ``item_cache``'s caches (before the reader closes)."""
    for cache in getattr(read, "caches", ()):
        await cache.aclose()

