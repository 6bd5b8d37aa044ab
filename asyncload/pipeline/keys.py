"""The item -> (what to read, label) rule: which part of a source item is read, which is its
label, and, in a mix, which source it came from. The pipelines apply it to each sample, the
parent to name a dead child's samples (``procs/parent.py``).
"""

from __future__ import annotations

from typing import Any, Sequence

from ..errors import SampleError
from ..sources.items import is_labelled
from ..sources.mix_source import MixedSource
from ..sources.shards import ShardSource


def split(source: Sequence[Any], labelled_items: bool, index: int) -> tuple[Any, Any]:
    """The source item at ``index`` -> (what to read, label or None). In a mix, the label is a
    tuple of the extra int64 fields the rows take: ``(label, source number)``, or
    ``(source number,)`` for unlabelled items (``jobs.write_label`` writes them)."""
    number = None
    if isinstance(source, MixedSource):
        part, local, number = source.locate(index)
        if not isinstance(source, ShardSource):  # a shard mix's own items carry the mix's index: its stream reads by it
            source, index = part, local
    try:
        item = source[index]
    except Exception as error:
        raise SampleError(f"source[{index}]", "source", error) from error
    label = None
    if labelled_items:
        if not is_labelled(item):
            raise SampleError(item, "source", TypeError("expected a (url, label) pair like the first item"))
        item, label = item[0], int(item[1])
    if number is None:
        return item, label
    return item, (number,) if label is None else (label, number)
