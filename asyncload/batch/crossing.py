"""What may travel from a child process to this one: the values a sample puts aside.

Fixed and ragged arrays never travel (a child writes them into shared memory); what goes aside
(``ragged.py``: strings, Python objects, arrays past their room) rides in the fill's answer,
pickled. A value that does not pickle (a ``memoryview``, a lock, an open file) would break that
answer, so a child checks each such value when it writes it, and the sample fails alone, naming
the field and the type (``CannotCross``; skippable). In this process nothing travels: such
values are handed out as they are, and the default (``processes=None``) looks at those it holds
before it moves to children (``unportable``), so that it never turns a working run into
failures.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable
from typing import Any

import numpy as np

from .layout import SampleLayout, leaf_names

PLAIN = frozenset({str, bytes, int, float, bool, type(None)})  # pickle without a look


class CannotCross(TypeError):
    """A sample's value cannot be sent from a child process to this one."""


def must_cross(layout: SampleLayout, number: int, value: Any) -> None:
    """Raises ``CannotCross`` naming leaf ``number`` of ``layout`` if ``value`` does not pickle.
    Only for values put aside in a child: a plain value or a numeric array costs a type check."""
    reason = _why_not(value)
    if reason is not None:
        raise CannotCross(_message(leaf_names(layout.tree)[number], value, reason))


def unportable(layout: SampleLayout | None, values: Iterable[tuple[int, Any]]) -> str | None:
    """Why samples like these could not come from child processes (the first value, by leaf,
    that does not pickle), as words for ``choice.py``'s line; None when they could."""
    if layout is None:
        return None
    seen: set[tuple[int, type]] = set()
    for number, value in values:
        if (number, type(value)) in seen:
            continue
        seen.add((number, type(value)))
        reason = _why_not(value)
        if reason is not None:
            return _message(leaf_names(layout.tree)[number], value, reason)
    return None


def _why_not(value: Any) -> str | None:
    if type(value) in PLAIN or (isinstance(value, np.ndarray) and not value.dtype.hasobject):
        return None
    try:
        pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return None


def _message(name: str, value: Any, reason: str) -> str:
    kind = type(value)
    what = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    return (f"field {name!r} is a {what}, which cannot travel between processes ({reason}): return arrays, "
            f"numbers, str or bytes, or use processes=0")
