"""What a loader reads: items (URLs, labelled pairs), tar shards and their index, other loaders' shards, Parquet, mixes of sources, and the writer."""
