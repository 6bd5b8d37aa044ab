"""What a loader reads: items (URLs, labelled pairs), tar shards and their index, and the shard writer."""
