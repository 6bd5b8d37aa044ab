"""Brace patterns as WebDataset names its shards (``train/{000000..000999}.tar``), expanded with
the semantics of the ``braceexpand`` package WebDataset uses (bash's, less its oddities), so a
pattern names the same shards here as there:

- ``{a,b,c}`` a list (nested lists and groups expand in place: ``{a,{b,c}}`` is a, b, c);
- ``{0..9}``, ``{9..0}``, ``{-1..1}`` integer ranges; a bound with a leading zero pads every
  number to the wider bound's width (``{1..010}`` is 001 ... 010); ``{0..6..2}`` steps;
- ``{a..e}``, ``{a..e..2}`` letter ranges (over ``A-Z`` then ``a-z``);
- ``{a}`` and ``{}`` (no comma, no range) are kept as they are, braces included;
- a backslash escapes the next character (``\\{`` is a literal brace); unbalanced braces raise.

Our own copy of the rule (a few dozen lines) rather than a dependency on a package that is no
longer released.
"""

from __future__ import annotations

import itertools
import re
import string

LETTERS = string.ascii_uppercase + string.ascii_lowercase
INT_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)(?:\.\.-?(\d+))?$")
CHAR_RANGE = re.compile(r"^([A-Za-z])\.\.([A-Za-z])(?:\.\.-?(\d+))?$")
ESCAPED = re.compile(r"\\(.)")


def expand(pattern: str) -> list[str]:
    """The strings ``pattern`` names, in order (see the module); ValueError on unbalanced braces."""
    return [ESCAPED.sub(r"\1", text) for text in _pattern(pattern)]


def _pattern(pattern: str) -> list[str]:
    """Literal text and top-level groups, each combination of their choices (escapes kept)."""
    parts: list[list[str]] = []
    start = depth = position = 0
    while position < len(pattern):
        char = pattern[position]
        if char == "\\":
            position += 2
            continue
        if char == "{":
            if depth == 0 and position > start:
                parts.append([pattern[start:position]])
                start = position
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                body = pattern[start + 1:position]
                choices = _group(body)
                parts.extend([["{"], _pattern(body), ["}"]] if choices is None else [choices])
                start = position + 1
        position += 1
    if depth != 0:
        raise ValueError(f"unbalanced braces in the pattern {pattern!r}")
    if start < len(pattern):
        parts.append([pattern[start:]])
    return ["".join(combination) for combination in itertools.product(*parts)]


def _group(body: str) -> list[str] | None:
    """The choices of one ``{...}``: a range or a comma list; None when it is neither."""
    numbers = INT_RANGE.match(body)
    if numbers:
        return _int_range(*numbers.groups())
    letters = CHAR_RANGE.match(body)
    if letters:
        return _char_range(*letters.groups())
    items, start, depth, position = [], 0, 0, 0
    while position < len(body):
        char = body[position]
        if char == "\\":
            position += 2
            continue
        depth += (char == "{") - (char == "}")
        if char == "," and depth == 0:
            items.append(body[start:position])
            start = position + 1
        position += 1
    if depth != 0 or not items:
        return None
    items.append(body[start:])
    return [text for item in items for text in _pattern(item)]


def _int_range(first: str, last: str, step: str | None) -> list[str]:
    padded = any(bound.startswith(("0", "-0")) for bound in (first, last) if bound not in ("0", "-0"))
    width = max(len(first), len(last)) if padded else 0
    stride = (int(step) or 1) if step else 1
    low, high = int(first), int(last)
    numbers = range(low, high + 1, stride) if low < high else range(low, high - 1, -stride)
    return [f"{number:0{width}d}" for number in numbers]


def _char_range(first: str, last: str, step: str | None) -> list[str]:
    stride = (int(step) or 1) if step else 1
    low, high = LETTERS.index(first), LETTERS.index(last)
    if low < high:
        return list(LETTERS[low:high + 1:stride])
    return list(LETTERS[low:(high or -len(LETTERS)) - 1:-stride])
