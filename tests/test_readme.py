"""The README's examples run as written (on the CPU, against the local S3 server)."""

import re
from pathlib import Path

import numpy as np
import pytest
import simplejpeg

README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.fixture(scope="module")
def bucket(s3_options):
    """``s3://my-bucket/imagenet/train/<class>/<i>.jpg``, as the examples expect."""
    import s3fs

    fs = s3fs.S3FileSystem(**s3_options, skip_instance_cache=True)
    fs.mkdir("my-bucket")
    for label in range(2):
        for index in range(4):
            image = np.full((300, 400, 3), 50 * index + label, np.uint8)
            fs.pipe_file(f"my-bucket/imagenet/train/class{label}/{index}.jpg", simplejpeg.encode_jpeg(image))
    return fs


def example(heading: str, replacements: tuple[tuple[str, str], ...]) -> str:
    """The first Python block under ``heading``, with the changes that let it run here."""
    code = re.search(rf"## {heading}\n\n.*?```python\n(.*?)```", README.read_text(), re.S).group(1)
    for old, new in replacements:
        assert old in code, f"the README example changed: {old!r} is gone; update this test"
        code = code.replace(old, new)
    return code


def test_readme_training_loop_runs(s3_options, bucket):
    code = example("Training from a bucket", (
        ("opts = {}", f"opts = {s3_options!r}"), ('device="cuda", ', ""), (").cuda()", ")"),
        ("range(90)", "range(2)"), ("batch_size=256", "batch_size=4")))
    scope: dict = {}
    exec(compile(code, str(README), "exec"), scope)
    assert scope["images"].shape == (4, 3, 224, 224)
    assert scope["labels"].tolist() != [] and np.isfinite(float(scope["loss"].detach()))
    scope["loader"].close()


def test_readme_shards_example_runs(s3_options, bucket, tmp_path):
    code = example("Tar shards for many small files", (
        ("samples_per_shard=1000", "samples_per_shard=3"), ('"/nvme/asyncload-cache"', repr(str(tmp_path))),
        ("batch_size=256", "batch_size=4")))
    scope: dict = {"opts": s3_options}
    exec(compile(code, str(README), "exec"), scope)
    with scope["loader"] as loader:
        labels = sorted(label for _, batch in loader for label in batch.tolist())
    assert labels == [0, 0, 0, 0, 1, 1, 1, 1]
    assert len(bucket.ls("my-bucket/imagenet/train-shards")) == 4  # three shards and the index
    assert len(list(tmp_path.glob("*.tar"))) == 3
