"""`python -m bench.memory` on a tiny run: the JSON holds a sample every ~0.2 s and a mark at the
end of each epoch, and the summary and the plot come out."""

from __future__ import annotations

import itertools
import json
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import simplejpeg

ROOT = Path(__file__).resolve().parent.parent


def test_memory_sampler_records_samples_every_interval_and_epoch_marks(tmp_path):
    images = tmp_path / "images"
    for label in range(2):
        (images / f"c{label}").mkdir(parents=True)
        for index in range(4):
            pixels = np.full((48, 64, 3), 40 * index + label, np.uint8)
            (images / f"c{label}" / f"{index}.jpg").write_bytes(simplejpeg.encode_jpeg(pixels))
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "bench.memory", "--cases", "biglist-asyncload", "biglist-dataloader",
         "--items", "20000", "--epoch-samples", "48", "--batch", "16", "--root", str(images), "--out", str(out)],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    (result_path,) = out.glob("*-memory.json")
    assert result_path.with_suffix(".png").stat().st_size > 10_000
    result = json.loads(result_path.read_text())
    assert result["settings"]["interval_s"] == 0.2
    for case in result["cases"]:
        assert case["ok"], case
        t = case["samples"]["t"]
        assert len(t) >= 5 and all(len(column) == len(t) for column in case["samples"].values())
        assert all(b >= a for a, b in itertools.pairwise(t))
        marked = {m["t"] for m in case["marks"]}
        periodic = [v for v in t if v not in marked]  # each mark adds a sample of its own
        gaps = [b - a for a, b in itertools.pairwise(periodic)]
        # on a loaded machine a sample may come late; the next one keeps to the schedule
        assert 0.1 < statistics.median(gaps) < 0.35, gaps
        assert 0.15 < (periodic[-1] - periodic[0]) / len(gaps) < 0.4, gaps
        ends = [m for m in case["marks"] if m["name"].startswith("epoch ")]
        assert [m["name"] for m in ends] == ["epoch 1 end", "epoch 2 end", "epoch 3 end"]
        assert ends[0]["t"] < ends[1]["t"] < ends[2]["t"] <= t[-1]
        assert [e["samples"] for e in case["epochs"]] == [48, 48, 48]
        assert len(case["pss_epoch_end"]) == 3 and case["peak_pss"] >= max(case["pss_epoch_end"]) > 0
        assert case["peak_rss"] >= case["peak_pss"] and case["growth_1_to_last_pct"] is not None
        assert f"{case['case']} (" in done.stdout and "growth 1->3" in done.stdout
    dataloader = next(c for c in result["cases"] if c["case"] == "biglist-dataloader")
    assert max(dataloader["samples"]["children"]) == 2  # its two forked workers are in the tree
