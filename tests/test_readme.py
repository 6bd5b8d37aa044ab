"""Every ```python block of README.md and docs/**/*.md runs as written (on the CPU, against the
local S3 server), so no example drifts from the code.

A page's blocks run in order in one namespace, as a reader runs them, from the repository root.
The namespace starts with ``opts``: the local server's storage options, standing for "your storage
options" (a page that sets ``opts = {}`` gets them too). Its bucket ``my-bucket`` holds class
folders of JPEGs under ``imagenet/train``, ``web`` and ``curated``. Before it runs, every block
gets the changes in ``HERE`` that let it run on this machine in seconds (no GPU, small batches);
each change must still apply to some block, so a stale one is noticed.

A block that cannot run here is marked on the line above its fence, visibly in the Markdown:
``<!-- not run: <why, and which test covers it instead> -->``.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import simplejpeg

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"(?:<!-- not run: (?P<why>[^\n]*?) -->\n)?```python\n(?P<code>.*?)```", re.S)
CACHE = "/nvme/asyncload-cache"
HERE = (  # (what the page says, what runs here)
    ('device="cuda", ', ""), (").cuda()", ")"), ("range(90)", "range(2)"), ("batch_size=256", "batch_size=4"),
    ("samples_per_shard=1000", "samples_per_shard=3"), ("rows_per_group=256", "rows_per_group=3"),
)


def blocks(page: Path) -> list[tuple[str | None, str]]:
    """The page's Python blocks: (why it is not run, or None; its code)."""
    return [(m["why"], m["code"]) for m in BLOCK.finditer(page.read_text())]


@pytest.fixture(scope="module")
def bucket(s3_options):
    """``s3://my-bucket/{imagenet/train,web,curated}/<class>/<i>.jpg``, as the examples expect."""
    import s3fs

    fs = s3fs.S3FileSystem(**s3_options, skip_instance_cache=True)
    fs.mkdir("my-bucket")
    for prefix in ("imagenet/train", "web", "curated"):
        for label in range(2):
            for index in range(4):
                image = np.full((300, 400, 3), 50 * index + label, np.uint8)
                fs.pipe_file(f"my-bucket/{prefix}/class{label}/{index}.jpg", simplejpeg.encode_jpeg(image))
    return fs


def run_page(page: Path, s3_options: dict, cache: Path) -> dict:
    """Runs the page's blocks in order in one namespace; returns it."""
    scope: dict = {"opts": dict(s3_options), "__name__": f"docs:{page.name}"}
    changes = (*HERE, ("opts = {}", f"opts = {s3_options!r}"), (CACHE, str(cache)))
    for why, code in blocks(page):
        if why is not None:
            assert why.strip(), f"{page}: a block marked 'not run' must say why"
            continue
        for old, new in changes:
            code = code.replace(old, new)
        exec(compile(code, str(page), "exec"), scope)
    return scope


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_page_examples_run(page, s3_options, bucket, tmp_path):
    scope = run_page(page, s3_options, tmp_path)
    try:
        if (check := CHECKS.get(str(page.relative_to(ROOT)))) is not None:
            check(scope, bucket, tmp_path)
    finally:  # a page may leave a loader open, as a reader's session would
        for value in scope.values():
            if type(value).__name__ == "AsyncLoader":
                value.close()


def test_every_change_applies_somewhere():
    code = "".join(code for page in PAGES for why, code in blocks(page) if why is None)
    assert [old for old, _ in (*HERE, ("opts = {}", ""), (CACHE, "")) if old not in code] == []


def _trained(scope: dict, bucket, cache: Path) -> None:
    assert scope["images"].shape == (4, 3, 224, 224)
    assert scope["labels"].tolist() != [] and np.isfinite(float(scope["loss"].detach()))


def _sharded(scope: dict, bucket, cache: Path) -> None:
    with scope["loader"] as loader:
        labels = sorted(label for _, batch in loader for label in batch.tolist())
    assert labels == [0, 0, 0, 0, 1, 1, 1, 1]
    assert len(bucket.ls("my-bucket/imagenet/train-shards")) == 4  # three shards and the index
    assert len(list(cache.glob("*.tar"))) == 3


def _parquet(scope: dict, bucket, cache: Path) -> None:
    with scope["loader"] as loader:
        labels = sorted(label for _, batch in loader for label in batch.tolist())
    assert labels == [0, 0, 0, 0, 1, 1, 1, 1]


CHECKS = {"README.md": _trained, "docs/getting-started.md": _trained, "docs/guides/shards.md": _sharded,
          "docs/guides/parquet.md": _parquet}
