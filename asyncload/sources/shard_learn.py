"""WebDataset tars as published: shards named by a brace pattern (``train/{000000..000999}.tar``,
``{a,b}``) or found in a folder, with no ``index.json``. The member table (``index_shards``'s
index) is learnt from the shards themselves and kept on local disk for the next runs.

What it costs, and when: before the first epoch, one streaming read of every shard (the bytes
of one epoch, ``LEARN_THREADS`` shards at once), printing its progress; then the index is
written atomically to ``index_dir`` (default: beside the shard cache, ``cache_dir``, else
``$XDG_CACHE_HOME/asyncload/indexes`` or ``~/.cache/asyncload/indexes``), under a name derived
from the shard URLs. Why learn up front rather than during the first epoch: the epoch's order, its length and the ranks' equal batch counts
(``DistributedSampler``'s padding) all need every shard's sample count, so a first epoch read
before they are known would have to be an epoch of another kind (unshuffled, unequal across
ranks, not resumable). Learning first keeps every epoch, the first included, the ordinary one.

Shared by a node's ranks and processes: the first to come takes an ``flock`` on the index's lock
file and learns; the others wait on that lock (a dead learner lets go of it; one that stops
beating for ``timeout`` is not waited for longer: ``io/heartbeat_lock``) and then read what it wrote. A kept index is used only if it names the same
shards with the same sizes and versions (ETag, else modification time: one listing of the
shards' folders checks that each run); else it is learnt again.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

from ..io import heartbeat_lock, object_store
from ..io.reader import version_of
from .. import redact
from . import brace, listing
from .shard_index import INDEX_FORMAT

LEARN_THREADS = 8  # shards read at once while learning (each a long streaming read)
PROGRESS_EVERY_S = 5.0
BRACE = re.compile(r"\{[^{}]*\}")


def expanded(patterns: str | Sequence[str], max_shards: int = brace.MAX_URLS) -> list[str]:
    """The shard URLs a pattern or a list of them names, in order (``brace.expand``: WebDataset's
    ``braceexpand``); ValueError naming the largest pattern, its count and the bound when they
    name more than ``max_shards`` together (counted before anything is expanded: a typo such as
    ``{0..9999999}`` would cost seconds and gigabytes), or naming any URL named twice, whose
    samples would otherwise come several times an epoch (``{000000,{000000,000001}}``)."""
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    counts = [brace.count(pattern) for pattern in patterns]
    if sum(counts) > max_shards:
        largest = max(range(len(patterns)), key=counts.__getitem__)
        others = f" ({sum(counts):,} with the {len(patterns) - 1} others)" if len(patterns) > 1 else ""
        raise ValueError(f"tar_shards: the brace pattern {redact.shown(patterns[largest], 200)} names "
                         f"{counts[largest]:,} shard URLs{others}, more than max_shards={max_shards:,}: a typo in a "
                         "range? If not, pass tar_shards(..., max_shards=N) with a larger N")
    urls = [url for pattern in patterns for url in brace.expand(pattern, max_shards)]
    seen: set[str] = set()
    twice = [url for url in urls if url in seen or seen.add(url)]  # type: ignore[func-returns-value]
    if twice:
        names = ", ".join(dict.fromkeys(redact.shown(url, 120) for url in twice[:3]))
        raise ValueError(f"tar_shards: {len(twice)} shard URL(s) named more than once after expanding the braces "
                         f"(their samples would come several times an epoch): {names}")
    return urls


def is_pattern(url: str) -> bool:
    """Whether ``url`` names shards itself (a brace pattern or a ``.tar``), not an index's folder."""
    return BRACE.search(url) is not None or url.endswith(".tar")


def index_path(urls: Sequence[str], index_dir: str | None, cache_dir: str | None) -> str:
    """Where the learnt index of ``urls`` is kept (see the module)."""
    user_cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    folder = index_dir or (os.path.join(cache_dir, "indexes") if cache_dir else
                           os.path.join(user_cache, "asyncload", "indexes"))
    name = hashlib.sha256("\n".join(urls).encode()).hexdigest()[:20]
    return os.path.join(folder, f"learnt-{name}.json")


def sizes_of(urls: Sequence[str], storage_options: dict | None, timeout: float | None,
             retries: int | None) -> list[int]:
    """Each shard's size, from one listing of each folder the shards are in (see ``listed``)."""
    return [size for size, _ in listed(urls, storage_options, timeout, retries)]


def listed(urls: Sequence[str], storage_options: dict | None, timeout: float | None,
           retries: int | None) -> list[tuple[int, str]]:
    """Each shard's ``(size, version)`` (version: its ETag, else its modification time, as the
    shard cache compares them), from one listing of each folder the shards are in;
    FileNotFoundError naming the shards that are not there (a brace range past the last shard,
    a typo)."""
    by_folder: dict[str, list[str]] = {}
    for url in urls:
        by_folder.setdefault(posixpath.dirname(url), []).append(url)
    found: dict[str, tuple[int, str]] = {}
    tries = listing.retries_for(retries, storage_options)
    for folder in by_folder:
        with listing.opened(folder, storage_options, timeout) as (fs, path):
            missing = redact.bounded(f"{folder}: no such folder or prefix (looked for the shards "
                                     f"{by_folder[folder][0]} ...)", 400)
            infos = listing.with_retries(folder, "listing", tries, missing, lambda: fs.find(path, maxdepth=1, detail=True))
            names = {fs._strip_protocol(name).rstrip("/"): (int(info["size"]), version_of(info))
                     for name, info in infos.items()}
            for url in by_folder[folder]:
                entry = names.get(fs._strip_protocol(url).rstrip("/"))
                if entry is not None:
                    found[url] = entry
    absent = [url for url in urls if url not in found]
    if absent:
        more = f" and {len(absent) - 3} more" if len(absent) > 3 else ""
        names = ", ".join(redact.bounded(url, 200) for url in absent[:3])  # a presigned URL's signature: hidden
        raise FileNotFoundError(f"{len(absent)} of {len(urls)} shards not found: {names}{more}")
    return [found[url] for url in urls]


def learnt_index(urls: Sequence[str], path: str, storage_options: dict | None, timeout: float | None,
                 retries: int | None) -> dict[str, Any]:
    """The index of the shards ``urls``: the one kept at ``path`` if it still matches them, else
    learnt now (see the module) and kept there. Shard URLs in it are absolute."""
    urls = list(urls)
    sizes_versions = listed(urls, storage_options, timeout, retries)
    sizes = [size for size, _ in sizes_versions]
    versions = [version for _, version in sizes_versions]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    patience = timeout if timeout is not None else object_store.LISTING_TIMEOUT_S
    lock = Path(path + ".lock")
    with heartbeat_lock.held(lock, patience, name="asyncload-learn-beat",
                             on_wait=lambda: _say(f"waiting for another process to learn the member table ({lock})"),
                             on_stalled=lambda: _say(f"the process learning the member table ({lock}) showed no "
                                                     f"progress for {patience:g} s: learning it here too")):
        kept = _kept(path, urls, sizes, versions)
        if kept is not None:
            return kept
        shards = learn(urls, sizes, storage_options, timeout, retries)
        for shard, version in zip(shards, versions):
            shard["version"] = version
        index = {"format": INDEX_FORMAT, "classes": [], "learnt": True, "shards": shards}
        temporary = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(temporary, "w") as file:
            json.dump(index, file)
        os.replace(temporary, path)
        return index


def learn(urls: list[str], sizes: list[int], storage_options: dict | None, timeout: float | None,
          retries: int | None) -> list[dict[str, Any]]:
    """Each shard's index entry, from one streaming read of it (``LEARN_THREADS`` at once),
    printing progress every ``PROGRESS_EVERY_S`` seconds."""
    from .writer import index_shard

    tries = listing.retries_for(retries, storage_options)
    total = sum(sizes)
    _say(f"no index.json: learning the member table of {len(urls)} shards ({total / 1e6:.1f} MB, read once; "
         "kept for the next runs)")

    def one(url: str) -> dict[str, Any]:
        def read() -> dict[str, Any] | ValueError:
            fs, path = object_store.url_to_fs(url, storage_options, listing=True, timeout=timeout)
            try:
                with fs.open(path, "rb") as file:
                    return index_shard(file, url)
            except ValueError as error:  # what the shard holds (not a read that failed): as it is
                return error
            finally:
                object_store.release(fs)

        entry = listing.with_retries(url, "reading", tries, redact.bounded(f"shard {url} not found", 400), read)
        if isinstance(entry, ValueError):
            raise entry
        return entry

    entries: list[dict[str, Any]] = []
    started = last = time.monotonic()
    done_bytes = 0
    with ThreadPoolExecutor(min(LEARN_THREADS, max(1, len(urls))), thread_name_prefix="asyncload-learn") as pool:
        for url, size, entry in zip(urls, sizes, pool.map(one, urls)):
            entries.append({"url": url, "bytes": size, **entry})
            done_bytes += size
            if time.monotonic() - last > PROGRESS_EVERY_S:
                last = time.monotonic()
                _say(f"learnt {len(entries)}/{len(urls)} shards ({done_bytes / 1e6:.1f}/{total / 1e6:.1f} MB, "
                     f"{done_bytes / 1e6 / (last - started):.1f} MB/s)")
    samples = sum(len(entry["keys"]) for entry in entries)
    _say(f"learnt {len(urls)} shards, {samples} samples, in {time.monotonic() - started:.1f} s")
    return entries


def _kept(path: str, urls: list[str], sizes: list[int], versions: list[str]) -> dict[str, Any] | None:
    """The index kept at ``path`` if it names exactly ``urls`` with ``sizes`` and ``versions``
    (a shard rewritten with the same size - tars are 10 KiB records - has another), else None."""
    try:
        with open(path) as file:
            index = json.load(file)
        shards = index["shards"]
        if [shard["url"] for shard in shards] == urls and [shard["bytes"] for shard in shards] == sizes \
                and [shard.get("version") for shard in shards] == versions:
            return index
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _say(message: str) -> None:
    print(f"asyncload: {message}", file=sys.stderr, flush=True)
