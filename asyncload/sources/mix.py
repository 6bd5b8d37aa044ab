"""Mixing datasets: several sources drawn by weight into one epoch.

The mix is itself a source: its index space is the sources laid end to end (``mix[i]`` is an
item of one of them), and its epoch sequence, which source gives each row and which of its items,
is a function of ``(seed, loader seed, epoch)`` alone. ``MixSampler`` (``order/mix_order.py``)
makes that sequence the epoch's order, so dealing to ranks, ``state_dict()`` and resume work as
for any source: a resumed epoch delivers exactly the rest of the same mixed sequence.

Each sample says which source it came from: the batch gains an int64 field, the index of the
source's name in ``sources`` (see ``mix``), written by the decode threads like a label.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from .items import is_labelled
from .mix_source import STOPS, MixedSource
from .shard_mix import MixedShards
from .shards import ShardSource


def mix(sources: Mapping[str, Sequence[Any]], weights: Mapping[str, float], *, seed: int = 0, stop: str = "first",
        length: int | None = None) -> MixedSource:
    """Several sources as one, each batch's rows drawn from them by weight: pass the result to
    ``AsyncLoader`` as its source.

    The draw is seeded: the same ``seed``, loader ``seed``, epoch and rank give the same sequence;
    within a source, items come in its own shuffled order from ``(seed, epoch, name)`` (for shard
    sources a shard order: shards shuffled, then a buffer shuffle, so reads stay large). With
    ``stop="first"`` and ``"never"`` each source gives exactly its weighted share of the epoch, in
    a seeded order; with ``"all"`` each sample's source is drawn by weight, a source that runs out
    drops out and the others' weights are renormalised.

    Each sample says where it came from: batches are ``(images, labels, source_ids)`` for sources
    of ``(url, label)`` items, ``(images, source_ids)`` for bare URLs (a custom ``decode``'s sample
    takes the place of ``images``), ``source_ids`` int64, the position of the sample's source in
    ``sources`` (``list(sources)[source_id]`` names it). Labels stay each source's own.
    ``loader.stats.sources`` counts the samples handed out per source (``as_dict()``:
    ``"mix/<name>/samples"``).

    Args:
        sources (dict of str -> source): name -> a source: ``image_folder``, ``list_files``,
            ``manifest`` or any sized, indexable sequence of items; or all ``tar_shards``, or all
            ``parquet`` (read as one shard set: see ``shard_mix.py``). All labelled or none.
        weights (dict of str -> float): the same names, positive numbers, normalised to sum 1.
        seed (int): the draw's and the sources' shuffles' seed (the loader's ``seed`` is added).
        stop ("first", "all" or "never"): when an epoch ends: "first" as soon as one source
            has given all its items (the others give their weighted share of that length);
            "all" once every source has (each item once); "never" after ``length`` samples,
            sources cycling (each pass a new shuffle).
        length (int): samples per epoch; required with ``stop="never"``, else not allowed.

    Raises:
        ValueError: names that differ between ``sources`` and ``weights``, a weight that is not
            a positive number, an empty source, labelled and unlabelled sources mixed, a ``stop``
            or ``length`` that does not fit.
        TypeError: another mix as a source; shard sources mixed with item sources, or
            ``tar_shards`` with ``parquet``.
    """
    if not sources:
        raise ValueError("mix() needs at least one source")
    if set(sources) != set(weights):
        raise ValueError(f"mix(): weights must name exactly the sources: sources {sorted(sources)}, "
                         f"weights {sorted(weights)}")
    kinds = {type(source) if isinstance(source, ShardSource) else None for source in sources.values()}
    if len(kinds) > 1:  # one shard stream reads a shard mix: every source must read the same way
        found = {name: type(source).__name__ if isinstance(source, ShardSource) else "items"
                 for name, source in sources.items()}
        raise TypeError(f"mix(): shard sources mix only with shard sources of the same kind (all tar_shards or all "
                        f"parquet), not with each other or with item sources: {found}")
    for name in sources:
        if not isinstance(name, str):
            raise ValueError(f"mix(): source names must be strings, got {name!r}")
        weight = weights[name]
        if isinstance(weight, bool) or not isinstance(weight, (int, float, np.integer, np.floating)) \
                or not np.isfinite(weight) or weight <= 0:
            raise ValueError(f"mix(): the weight of {name!r} must be a positive number, got {weight!r}")
        source = sources[name]
        if isinstance(source, MixedSource):
            raise TypeError(f"mix(): source {name!r} is a {type(source).__name__}: a mix cannot be mixed again")
        if len(source) == 0:
            raise ValueError(f"mix(): source {name!r} is empty")
    labelled = {name: is_labelled(sources[name][0]) for name in sources}
    if len(set(labelled.values())) > 1:
        raise ValueError(f"mix(): sources must all have (url, label) items or none: {labelled}")
    if stop not in STOPS:
        raise ValueError(f"mix(): stop must be 'first', 'all' or 'never', got {stop!r}")
    if stop == "never" and (isinstance(length, bool) or not isinstance(length, int) or length < 1):
        raise ValueError(f"mix(stop='never') needs length=, a positive number of samples per epoch, got {length!r}")
    if stop != "never" and length is not None:
        raise ValueError(f"mix(): length= is for stop='never' (stop={stop!r} decides the epoch's length)")
    if kinds == {None}:
        return MixedSource(sources, weights, seed, stop, length)
    return MixedShards(sources, weights, seed, stop, length)
