"""WebDataset-style decoding of a sample's members: ``tar_shards(url, members="all")`` gives each
sample as ``{extension: bytes}`` (``jpg``, ``cls``, ``txt``, ``json``, ``npy``, ...) and ``mds``
/ ``litdata`` give ``{column: value}``; ``Members`` turns such a dict into what a batch holds.

Why by extension, as WebDataset's ``.decode()``: the extension is the only type information a
tar member has, and users of WebDataset already name their members that way. A value that is
not bytes (an MDS or litdata column already decoded by its source) is kept as it is, unless it is
an image column's encoded bytes.
"""

from __future__ import annotations

import io
import json
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .names import INT_EXTENSIONS, TEXT_EXTENSIONS, is_image


def decode_member(name: str, value: Any, image: Callable[[bytes], Any] | None = None,
                  images: Sequence[str] = ()) -> Any:
    """One member's value from its bytes, by the extension of its ``name`` (the part after the
    last dot, lower-cased): an image extension (or a name in ``images``, or ``image``/``img``)
    through ``image``;
    ``cls``/``cls2``/``index``/``label``/``id`` an int; ``txt``/``text``/``caption`` a str;
    ``json`` the parsed JSON; ``npy`` a NumPy array (no pickled objects). Any other bytes stay
    bytes; a value that is not bytes is kept."""
    if not isinstance(value, (bytes, bytearray, memoryview)):
        return value
    extension = name.rsplit(".", 1)[-1].lower()
    if is_image(name) or name in images:
        if image is None:
            from .image import ImageDecoder

            image = ImageDecoder()
        return image(bytes(value))
    if extension in INT_EXTENSIONS:
        return int(bytes(value).decode("ascii").strip())
    if extension in TEXT_EXTENSIONS:
        return bytes(value).decode("utf-8")
    if extension == "json":
        return json.loads(bytes(value))
    if extension == "npy":
        return np.load(io.BytesIO(bytes(value)), allow_pickle=False)
    return bytes(value)


class Members:
    """A ``decode`` for samples given as a dict of members (``tar_shards(..., members="all")``,
    ``mds``, ``litdata``): each member decoded by ``decode_member``, then

    - with ``fields`` (``Members("jpg", "cls")``): a tuple of those members in that order, as
      WebDataset's ``.to_tuple("jpg", "cls")``; a field may name alternatives, ``"jpg;png"``,
      the first one present counting. A sample missing a field fails, naming it;
    - without: a dict of every member, by name.

    Args:
        *fields (str): the members to keep, in order (none: every member, as a dict).
        image (callable, default ImageDecoder()): decodes an image member's bytes.
        images (sequence of str, default ()): names (not extensions) of members that are encoded
            images, e.g. an MDS column called ``"image"``.
    """

    def __init__(self, *fields: str, image: Callable[[bytes], Any] | None = None, images: Sequence[str] = ()) -> None:
        if image is None:
            from .image import ImageDecoder

            image = ImageDecoder()
        self.fields = [field.split(";") for field in fields]
        self.image = image
        self.images = tuple(images)

    def __call__(self, sample: Mapping[str, Any]) -> Any:
        if not isinstance(sample, Mapping):
            raise TypeError(f"Members decodes a dict of members, got {type(sample).__name__}")
        if not self.fields:
            return {name: decode_member(name, value, self.image, self.images) for name, value in sample.items()}
        out = []
        for choices in self.fields:
            name = next((choice for choice in choices if choice in sample), None)
            if name is None:
                raise KeyError(f"no member {' or '.join(map(repr, choices))} (it has {', '.join(map(repr, sample))})")
            out.append(decode_member(name, sample[name], self.image, self.images))
        return tuple(out) if len(out) > 1 else out[0]

    def __repr__(self) -> str:
        return f"Members({', '.join(repr(';'.join(f)) for f in self.fields)})"
