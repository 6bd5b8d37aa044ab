"""The README's training loop runs as written (on the CPU, against the local S3 server)."""

import re
from pathlib import Path

import numpy as np
import simplejpeg

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_training_loop_runs(s3_options):
    import s3fs

    fs = s3fs.S3FileSystem(**s3_options, skip_instance_cache=True)
    fs.mkdir("my-bucket")
    for label in range(2):
        for index in range(4):
            image = np.full((300, 400, 3), 50 * index + label, np.uint8)
            fs.pipe_file(f"my-bucket/imagenet/train/class{label}/{index}.jpg", simplejpeg.encode_jpeg(image))
    code = re.search(r"## Training from a bucket\n\n```python\n(.*?)```", README.read_text(), re.S).group(1)
    for old, new in (("opts = {}", f"opts = {s3_options!r}"), ('device="cuda", ', ""), (").cuda()", ")"),
                     ("range(90)", "range(2)"), ("batch_size=256", "batch_size=4")):
        assert old in code, f"the README example changed: {old!r} is gone; update this test"
        code = code.replace(old, new)
    scope: dict = {}
    exec(compile(code, str(README), "exec"), scope)
    assert scope["images"].shape == (4, 3, 224, 224)
    assert scope["labels"].tolist() != [] and np.isfinite(float(scope["loss"].detach()))
    scope["loader"].close()
