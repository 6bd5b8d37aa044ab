"""The item cache as the pipeline uses it: which items of a source (an ``image_folder``,
``list_files`` or ``manifest`` with ``cache_dir``, alone or mixed) are read through a disk cache
(``io/cache_items.py``), and closing those caches with the run. Here, not in ``io/``: knowing the
sources is the pipeline's business, and ``io/`` stays below them.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from ..io.cache_items import CopyRead, ItemCache, KeptIndex
from ..sources.items import Source
from ..sources.mix_source import MixedSource


class CachedReads:
    """How the pipeline reads the items of a source with a ``cache_dir``: ``hit`` (a copy the
    decode thread reads itself) or ``read`` (an awaitable, on the loop); both None for an item
    not cached (a local file, a part of a mix without ``cache_dir``)."""

    def __init__(self, caches: dict[int, ItemCache], locate: Callable[[int], tuple[Any, int]], reader: Any) -> None:
        self.caches = caches
        self.locate = locate
        self.reader = reader

    def _cache(self, key: Any, index: int) -> tuple[ItemCache | None, int]:
        part, local = self.locate(index)
        cache = self.caches.get(id(part))
        if cache is None or not isinstance(key, str) or self.reader.is_local(key):
            return None, local
        return cache, local

    def hit(self, key: Any, index: int) -> CopyRead | None:
        cache, local = self._cache(key, index)
        return None if cache is None else cache.hit(key, local)

    def read(self, key: Any, index: int, copy: bool = True) -> Awaitable[bytes | CopyRead] | None:
        """The item's bytes, or (with ``copy``) a ``CopyRead`` of a current copy, for the decode
        thread to read."""
        cache, local = self._cache(key, index)
        return None if cache is None else cache.fetch(key, local, copy)

    async def aclose(self) -> None:
        """Writes what the caches hold still and lets go of their segments (before the reader closes)."""
        for cache in self.caches.values():
            await cache.aclose()


def item_cache(source: Any, reader: Any, kept: KeptCaches) -> CachedReads | None:
    """``CachedReads`` for ``source``, or None when no part of it has a ``cache_dir``. A mix's
    parts each keep their own cache, on what ``kept`` holds from the loader's last pass."""
    if isinstance(source, Source):
        parts, locate = [source], lambda index: (source, index)
    elif isinstance(source, MixedSource) and all(isinstance(p, Source) for p in source.sources):
        parts, locate = list(source.sources), lambda index: source.locate(index)[:2]
    else:
        return None
    caches = {id(p): ItemCache(p.cache_dir, p.cache_bytes, reader, p.listed if p.has_listing else None,
                               kept.item_index(p))
              for p in parts if getattr(p, "cache_dir", None) is not None}
    return CachedReads(caches, locate, reader) if caches else None


class KeptCaches:
    """What the caches of one loader's passes keep from one pass to the next in this process
    (``LocalPipes`` builds a pipeline per pass, with a new loop and reader; a child's pipeline
    lives for all its passes): each item cache's ``KeptIndex`` (its index, open segments and
    storage's answers: rebuilt, a pass parsed every record and asked storage about every
    unlisted object again) and, per shard source, which copies are known current (rebuilt, a
    pass asked storage about every shard again and could not read its samples from the copies
    straight away). A new loader is a new run: it asks again. ``close`` with the loader."""

    def __init__(self) -> None:
        self.items: dict[tuple[int, str, int | None], KeptIndex] = {}  # (id of a source, cache_dir, cache_bytes)
        self.shards: dict[tuple[int, str], dict[str, float]] = {}  # (id of a source, cache_dir) -> url -> until

    def item_index(self, source: Source) -> KeptIndex:
        key = (id(source), str(source.cache_dir), source.cache_bytes)
        kept = self.items.get(key)
        if kept is None:
            kept = self.items[key] = KeptIndex(str(source.cache_dir), source.cache_bytes)
        return kept

    def shard_copies(self, source: Any) -> dict[str, float]:
        """``ShardCache``'s ``current`` for ``source``'s cache (see ``io/cache.py``)."""
        return self.shards.setdefault((id(source), str(source.cache_dir)), {})

    def close(self) -> None:
        """Closes the kept segments' descriptors (a read still using one closes it after)."""
        for kept in self.items.values():
            kept.close()
        self.items.clear()
        self.shards.clear()
