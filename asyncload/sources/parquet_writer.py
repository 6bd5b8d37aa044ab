"""Writing a Parquet file from any source (URLs, or ``(url, label)`` pairs), as ``write_shards``
writes tar shards: the image bytes as they are and the label, ``rows_per_group`` rows a row
group (the unit ``parquet()`` reads and shuffles by).

Why these settings: images are compressed already, so their column is stored without
compression or dictionary (compressing it again costs CPU on every read and saves nothing);
a row group is what the loader reads at once, so the default 256 rows (~28 MB of
ImageNet JPEGs) keeps a read near tar shards' 16 MB chunks; the class names are recorded where Hugging Face ``datasets`` records a ClassLabel's, so
``parquet()`` (and ``datasets``) find them.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from .parquet_files import pyarrow_parquet
from .writer import Clients


def write_parquet(source: Sequence[Any], dest: str, *, rows_per_group: int = 256,
                  storage_options: dict | None = None, image: str = "image", label: str = "label") -> str:
    """Writes the items of ``source`` (e.g. ``image_folder`` or ``manifest``) to the Parquet file
    ``dest`` (local or bucket URL): column ``image`` the encoded bytes, column ``label`` the label
    when items are ``(url, label)`` pairs; ``rows_per_group`` rows a row group. Items are read
    concurrently through the loader's client; a row group is held in memory at a time. Returns
    ``dest``."""
    pq = pyarrow_parquet()
    import pyarrow as pa

    if rows_per_group < 1:
        raise ValueError(f"rows_per_group must be at least 1, got {rows_per_group}")
    labelled = len(source) > 0 and isinstance(source[0], (tuple, list))
    fields = [pa.field(image, pa.binary())] + ([pa.field(label, pa.int64())] if labelled else [])
    classes = list(getattr(source, "classes", []) or [])
    metadata = {}
    if labelled and classes:
        features = {image: {"_type": "Image"}, label: {"names": classes, "_type": "ClassLabel"}}
        metadata[b"huggingface"] = json.dumps({"info": {"features": features}}).encode()
    schema = pa.schema(fields, metadata=metadata or None)
    with Clients(storage_options or {}) as clients:
        out_fs, path = clients.for_url(dest)
        parent = path.rsplit("/", 1)[0] if "/" in path else ""
        if parent:
            out_fs.makedirs(parent, exist_ok=True)
        with out_fs.open(path, "wb") as file:
            writer = pq.ParquetWriter(file, schema, compression={image: "NONE", **({label: "SNAPPY"} if labelled else {})},
                                      use_dictionary=[label] if labelled else False, write_statistics=[label] if labelled else False)
            try:
                for start in range(0, len(source), rows_per_group):
                    items = [source[i] for i in range(start, min(start + rows_per_group, len(source)))]
                    urls = [item[0] if labelled else item for item in items]
                    columns = [pa.array(list(clients.read_all(urls)), pa.binary())]
                    if labelled:
                        columns.append(pa.array([int(item[1]) for item in items], pa.int64()))
                    writer.write_table(pa.Table.from_arrays(columns, schema=schema), row_group_size=rows_per_group)
            finally:
                writer.close()
    return dest
