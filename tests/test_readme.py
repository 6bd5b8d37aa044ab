"""Every ```python block of README.md and docs/**/*.md runs as written (on the CPU, against the
local S3 server), so no example drifts from the code.

A page's blocks run in order in one namespace, as a reader runs them, from the repository root.
The namespace starts with ``opts``: the local server's storage options, standing for "your storage
options" (a page that sets ``opts = {}`` gets them too). Its bucket ``my-bucket`` holds class
folders of JPEGs under ``imagenet/train``, ``web`` and ``curated``. Before it runs, every block
gets the changes in ``HERE`` that let it run on this machine in seconds (no GPU, small batches);
each change must still apply to some block, so a stale one is noticed.

A block that cannot run here is marked on the line above its fence, visibly in the Markdown:
``<!-- not run: <why, and which test covers it instead> -->``. A block that is a whole script run
by a launcher (DDP with 2 CPU processes: Lightning's own launcher, torchrun) is marked
``<!-- run as: python script.py -->`` or ``<!-- run as: torchrun --nproc_per_node=2 script.py -->``:
it gets the same changes, is written to ``script.py`` in a fresh folder and run there as said,
with the local server's options in place of ``opts = {}``, and must exit with 0 in time.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest
import simplejpeg

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"(?:<!-- (?:not run: (?P<why>[^\n]*?)|run as: (?P<how>[^\n]*?)) -->\n)?```python\n(?P<code>.*?)```",
                   re.S)
CACHE = "/nvme/asyncload-cache"
RUNS = "/nvme/runs"  # where the trainers' pages keep checkpoints and logs: the test's own folder
SCRIPT_TIMEOUT = 240.0  # seconds: a rank left waiting for another fails the page instead of hanging it
HERE = (  # (what the page says, what runs here)
    ('device="cuda", ', ""), (").cuda()", ")"), ("range(90)", "range(2)"), ("batch_size=256", "batch_size=4"),
    ("samples_per_shard=1000", "samples_per_shard=3"), ("rows_per_group=256", "rows_per_group=3"),
)


def blocks(page: Path) -> list[tuple[str | None, str]]:
    """The page's Python blocks: (why it is not run, or None; its code). A script's ``why`` is
    ``"run as: <command>"``."""
    return [(m["why"] if m["how"] is None else f"run as: {m['how']}", m["code"])
            for m in BLOCK.finditer(page.read_text())]


def run_script(code: str, how: str, folder: Path) -> None:
    """Runs ``code`` as ``script.py`` in ``folder`` with ``how`` (``python script.py`` or
    ``torchrun ... script.py``); fails with its output unless it exits with 0 in time."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "script.py").write_text(code)
    launcher, *arguments = how.split()
    command = ([sys.executable, *arguments] if launcher == "python"
               else [sys.executable, "-m", "torch.distributed.run", "--standalone", "--max_restarts=0", *arguments])
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    process = subprocess.Popen(command, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    try:
        output, _ = process.communicate(timeout=SCRIPT_TIMEOUT)
    except subprocess.TimeoutExpired:
        for child in psutil.Process(process.pid).children(recursive=True):
            child.kill()
        process.kill()
        output, _ = process.communicate()
        pytest.fail(f"`{how}` did not finish within {SCRIPT_TIMEOUT:.0f} s:\n{output[-4000:]}", pytrace=False)
    assert process.returncode == 0, f"`{how}` exited with {process.returncode}:\n{output[-4000:]}"


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
    changes = (*HERE, ("opts = {}", f"opts = {s3_options!r}"), (CACHE, str(cache)), (RUNS, str(cache / "runs")))
    (cache / "runs").mkdir(exist_ok=True)
    for why, code in blocks(page):
        if why is not None and not why.startswith("run as: "):
            assert why.strip(), f"{page}: a block marked 'not run' must say why"
            continue
        for old, new in changes:
            code = code.replace(old, new)
        if why is not None:
            run_script(code, why.removeprefix("run as: "), cache / "script")
            continue
        exec(compile(code, str(page), "exec"), scope)
    return scope


@pytest.mark.timeout(2 * SCRIPT_TIMEOUT)  # a trainer's page runs a 2-process script besides its blocks
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
    code = "".join(code for page in PAGES for why, code in blocks(page) if why is None or why.startswith("run as: "))
    assert [old for old, _ in (*HERE, ("opts = {}", ""), (CACHE, ""), (RUNS, "")) if old not in code] == []


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
