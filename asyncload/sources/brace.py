"""Brace patterns as WebDataset names its shards (``train/{000000..000999}.tar``), expanded by
``braceexpand``, the package WebDataset itself uses, so a pattern names the same shards here as
there:

- ``{a,b,c}`` a list (nested lists and groups expand in place: ``{a,{b,c}}`` is a, b, c);
- ``{0..9}``, ``{9..0}``, ``{-1..1}`` integer ranges; a bound with a leading zero pads every
  number to the wider bound's width (``{1..010}`` is 001 ... 010); ``{0..6..2}`` steps;
- ``{a..e}``, ``{a..e..2}`` letter ranges (over ``A-Z`` then ``a-z``);
- ``{a}`` and ``{}`` (no comma, no range) are kept as they are, braces included;
- a backslash escapes the next character (``\\{`` is a literal brace); unbalanced braces raise.

Why count first (``count``): one digit too many in a range (``{0..9999999}``) would make ten
million strings (42 s and 1.6 GB) before the first shard is even listed, and ``{0..999999999}``
runs out of memory; ``braceexpand`` builds every string before giving the first. So the number of
strings is worked out from the pattern's parse alone (ranges' lengths, lists' sums, groups'
products: microseconds whatever the count), and a pattern past ``max_urls`` is refused before
anything is expanded.
"""

from __future__ import annotations

import re

from braceexpand import alphabet, braceexpand

from ..redact import shown

MAX_URLS = 1_000_000  # the most URLs a pattern may name unless the caller allows more
INT_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)(?:\.\.-?(\d+))?$")  # braceexpand's grammar, for count()
CHAR_RANGE = re.compile(r"^([A-Za-z])\.\.([A-Za-z])(?:\.\.-?(\d+))?$")


def expand(pattern: str, max_urls: int = MAX_URLS) -> list[str]:
    """The strings ``pattern`` names, in order (see the module); ValueError on unbalanced braces,
    or naming the pattern and its count when it names more than ``max_urls``, before expanding."""
    urls = count(pattern)
    if urls > max_urls:
        raise ValueError(f"the brace pattern {shown(pattern, 200)} names {urls:,} URLs, more than the bound of "
                         f"{max_urls:,}")
    return list(braceexpand(pattern))


def count(pattern: str) -> int:
    """How many strings ``braceexpand(pattern)`` gives, from parsing ``pattern`` alone (its
    ``parse_pattern``: literal text and top-level groups, the product of their choices);
    ValueError on unbalanced braces, as ``braceexpand``."""
    total = 1
    start = depth = position = 0
    while position < len(pattern):
        char = pattern[position]
        if char == "\\":
            position += 2
            continue
        if char == "{":
            if depth == 0:
                start = position
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                total *= _group_count(pattern[start + 1:position])
        position += 1
    if depth != 0:
        raise ValueError(f"Unbalanced braces: {pattern!r}")
    return total


def _group_count(body: str) -> int:
    """How many choices one ``{body}`` gives: a range's length, a list's items' counts summed,
    else the body's own count (``{a}`` stays as it is, braces included)."""
    numbers = INT_RANGE.match(body)
    if numbers:
        first, last, step = numbers.groups()
        stride = (int(step) or 1) if step else 1
        low, high = int(first), int(last)
        return len(range(low, high + 1, stride) if low < high else range(low, high - 1, -stride))
    letters = CHAR_RANGE.match(body)
    if letters:
        first, last, step = letters.groups()
        stride = (int(step) or 1) if step else 1
        low, high = alphabet.index(first), alphabet.index(last)
        return len(alphabet[low:high + 1:stride] if low < high else alphabet[low:(high or -len(alphabet)) - 1:-stride])
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
        return count(body)
    items.append(body[start:])
    return sum(count(item) for item in items)
