"""The committed fixtures of the other loaders' formats are still what their writers write today:
``tests/fixtures/make_formats.py`` is run afresh (its own process: litdata's ``optimize()``
starts its worker by spawning) and every file compared byte for byte with the committed one. A
writer that changes its layout fails here, before users meet it. Skipped where the writer is not
installed (CI installs litdata without its torchvision, and zstd: see ``.ci/run``); MosaicML
Streaming's writer requires torchvision, so its fixture is not rewritten here."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures" / "formats"
SCRIPT = Path(__file__).parent / "fixtures" / "make_formats.py"
NEEDS = {"litdata": ["litdata"], "litdata_arrow": ["litdata", "pyarrow"],
         "litdata_nested_zstd": ["litdata", "pyarrow", "zstd"], "wds": ["webdataset"]}


@pytest.mark.parametrize("name", list(NEEDS))
def test_the_committed_fixture_is_what_its_writer_writes_today(name, tmp_path):
    missing = [module for module in NEEDS[name] if importlib.util.find_spec(module) is None]
    if missing:
        pytest.skip(f"the writer of {name} needs {', '.join(missing)}")
    subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), name], check=True, capture_output=True, timeout=300)
    written, committed = tmp_path / name, FIXTURES / name
    assert sorted(p.name for p in written.iterdir()) == sorted(p.name for p in committed.iterdir())
    for path in committed.iterdir():
        fresh = written / path.name
        if path.suffix == ".json":
            assert json.loads(fresh.read_text()) == json.loads(path.read_text()), path.name
        else:
            assert fresh.read_bytes() == path.read_bytes(), f"{path.name} differs: rerun {SCRIPT.name} and read the diff"
