"""The disk caches, in one place: the shard cache (``shards.py``: whole tar shards, downloaded
once per node) and the item cache (``items.py``: objects of an item source packed into
``item_files.py``'s segment files, and which items of a source it serves); the rules that make a
folder shared by a node's processes safe (``files.py``), the lock a peer's download is waited on
by (``lock.py``), a download and the reads served from it while under way (``download.py``),
eviction (``evict.py``) and storage that cannot be asked (``offline.py``). It reads through
``io/``; the shard stream (``sources/shard_stream.py``) and the pipeline (``pipeline/``) use it.
"""
