"""The headline figure (``bench/headline.py``) is drawn from committed result files, without a
new run: the latest full run of the latest day (not a same-day rerun of one workload, not a
quick run), each workload's default against its best DataLoader, and the 16-core GPU box's rows
where its files are there."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bench import headline

RESULTS = Path(headline.__file__).resolve().parent / "results"
FULL, RERUN, OLDER = "amd-epyc-2c-2026-11-28.json", "amd-epyc-2c-2026-11-28-local.json", "amd-epyc-2c-2026-11-23.json"
GPU = ["h200-16c-2026-11-28-cores.txt", "h200-16c-2026-11-28-loaders-procs.json"]


def results(tmp_path: Path, names: list[str]) -> Path:
    folder = tmp_path / "results"
    folder.mkdir()
    for name in names:
        shutil.copy(RESULTS / name, folder / name)
    quick = json.loads((RESULTS / FULL).read_text())  # a later quick run never makes the headline
    quick["started"], quick["settings"]["quick"] = "2026-11-29T10:00:00", True
    (folder / "amd-epyc-2c-2026-11-29-quick.json").write_text(json.dumps(quick))
    return folder


def test_the_headline_is_the_latest_full_run_and_the_gpu_box(tmp_path):
    folder = results(tmp_path, [FULL, RERUN, OLDER, *GPU])
    assert headline.latest_run(folder).name == FULL
    out = headline.draw(folder, tmp_path / "docs" / "headline.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = headline.run_rows(json.loads((folder / FULL).read_text()))
    got = {row.label: (round(row.ratio, 2), row.baseline) for row in rows}
    assert got == {  # the README's table of that run
        "local JPEGs, batch 256": (0.86, "2 workers"),
        "S3 (same-box server), batch 256": (1.66, "4 workers"),
        "S3 + 20-50 ms latency, batch 48": (6.84, "4 workers"),
        "tar shards, S3 + latency, batch 48": (11.19, "4 workers on objects"),
        "large samples, batch 128": (4.22, "4 workers"),
        "consumer-bound step, batch 48": (1.03, "2 workers"),
        "Python-bound step, batch 48": (0.61, "2 workers"),
    }
    gpu, caption = headline.gpu_rows(folder)
    assert [(row.label, round(row.ratio, 2)) for row in gpu] == [("16 cores: JPEGs, batches to the GPU", 0.96),
                                                                 ("16 cores: JPEGs, float on the GPU", 0.72)]
    assert caption == "16-core Intel Xeon + NVIDIA H200, 2026-11-28"


def test_without_the_gpu_box_files_its_rows_are_left_out(tmp_path):
    folder = results(tmp_path, [OLDER])
    assert headline.gpu_rows(folder) == ([], None)
    assert headline.draw(folder, tmp_path / "headline.png").stat().st_size > 0


def test_a_folder_without_a_full_run_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="no full `python -m bench` run in"):
        headline.latest_run(results(tmp_path, []))
