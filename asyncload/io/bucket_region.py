"""Which region an S3 bucket is in, for buckets whose region nothing configures: s3fs finds it by
itself, obstore's client assumes us-east-1. One unsigned HEAD per bucket answers it; it blocks,
so the reader asks on an I/O thread before a bucket's first read, never on the event loop.
"""

from __future__ import annotations

import os
from typing import Any

# Where S3 says which region a bucket is in (the x-amz-bucket-region header of any answer,
# even a redirect or a denial), for buckets whose region nothing configures: s3fs finds it
# by itself, object_store assumes us-east-1.
AWS_BUCKET_REGION_URL = "https://s3.amazonaws.com/{bucket}"
REGION_KEYS = {"region", "aws_region", "default_region", "aws_default_region", "endpoint", "aws_endpoint",
               "aws_endpoint_url", "endpoint_url"}


def region_known(config: dict[str, Any], provider: Any) -> bool:
    """Whether a region (or an endpoint other than AWS's) is set in the options, the environment
    or the credential provider."""
    keys = {k.lower() for k in config} | {k.lower() for k in getattr(provider, "config", None) or {}}
    # four lookups, not a copy of the environment: this runs at every read of obstore's S3
    env = any(name in os.environ for name in ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT", "AWS_ENDPOINT_URL"))
    return bool(keys & REGION_KEYS) or env


_regions: dict[str, str | None] = {}  # bucket -> the region S3 named for it (None: it named none)


def region_found(bucket: str) -> str | None:
    """The region S3 named for ``bucket`` if it was asked already (``bucket_region``), else None:
    what an event loop may use, as it must not wait for the question."""
    return _regions.get(bucket)


def region_to_find(fs: Any, path: str) -> str | None:
    """The bucket of ``path`` whose region ``fs`` (obstore's S3) would ask S3 for when it first
    serves it, if not asked yet; else None."""
    if not hasattr(fs, "_credential_provider") or fs.protocol not in ("s3", "s3a"):
        return None  # not obstore's S3 (s3fs finds regions itself)
    bucket = path.split("://", 1)[-1].split("/", 1)[0]
    if bucket in _regions or region_known(fs._config or {}, fs._credential_provider):
        return None
    return bucket


def bucket_region(bucket: str, timeout: float = 5.0) -> str | None:
    """The region S3 names for ``bucket`` in one unsigned HEAD (None if it names none), asked
    once per bucket. Blocks up to ``timeout``: never call it on an event loop."""
    if bucket in _regions:
        return _regions[bucket]
    import urllib.error
    import urllib.request

    request = urllib.request.Request(AWS_BUCKET_REGION_URL.format(bucket=bucket), method="HEAD")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            region = response.headers.get("x-amz-bucket-region")
    except urllib.error.HTTPError as answer:  # 301, 403: still an answer with the header
        region = answer.headers.get("x-amz-bucket-region")
    except OSError:
        region = None
    _regions[bucket] = region  # one dict store: atomic; two threads asking at once both ask
    return region
