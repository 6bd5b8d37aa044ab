"""The names that say what a member or column holds, for every source that reads samples of
several members (tar shards, MDS, litdata, Parquet) and for the decoders that name them: the
vocabulary ``members.py`` decodes by and ``image.py`` names in its errors, apart from both so
that neither imports the other (``members`` makes an ``ImageDecoder``; ``image`` says to pass
``Members``)."""

from __future__ import annotations

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff")  # also MDS's jpeg/png encodings
IMAGE_NAMES = ("image", "img")  # columns of that name (MDS, litdata, Parquet) hold encoded images
LABEL_MEMBER = "cls"  # a WebDataset sample's class number (write_shards writes it, tar_shards reads it)
LABEL_NAMES = ("label", "labels", LABEL_MEMBER, "class", "target", "y")  # a column taken as the label
INT_EXTENSIONS = (LABEL_MEMBER, "cls2", "index", "label", "id")
TEXT_EXTENSIONS = ("txt", "text", "caption")


def is_image(name: str) -> bool:
    """Whether a member or column ``name`` (or an encoding's name) holds an encoded image."""
    return name.rsplit(".", 1)[-1].lower() in IMAGE_EXTENSIONS or name in IMAGE_NAMES
