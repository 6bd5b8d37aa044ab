"""The committed fixtures of the other loaders' formats are still what their writers write today:
``tests/fixtures/make_formats.py`` is run afresh (its own process, once for all of them:
litdata's ``optimize()`` starts its worker by spawning) and every file compared byte for byte with the committed one. A
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


def missing(name: str) -> list[str]:
    return [module for module in NEEDS[name] if importlib.util.find_spec(module) is None]


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    """Every fixture whose writer is installed, written afresh by one run of the script: one
    process (and litdata's import) for all, not one per fixture."""
    out = tmp_path_factory.mktemp("formats")
    names = [name for name in NEEDS if not missing(name)]
    if names:
        subprocess.run([sys.executable, str(SCRIPT), str(out), *names], check=True, capture_output=True, timeout=300)
    return out


@pytest.mark.parametrize("name", list(NEEDS))
def test_the_committed_fixture_is_what_its_writer_writes_today(name, written):
    if missing(name):
        pytest.skip(f"the writer of {name} needs {', '.join(missing(name))}")
    fresh_dir, committed = written / name, FIXTURES / name
    assert sorted(p.name for p in fresh_dir.iterdir()) == sorted(p.name for p in committed.iterdir())
    for path in committed.iterdir():
        fresh = fresh_dir / path.name
        if path.suffix == ".json":
            assert json.loads(fresh.read_text()) == json.loads(path.read_text()), path.name
        else:
            assert fresh.read_bytes() == path.read_bytes(), f"{path.name} differs: rerun {SCRIPT.name} and read the diff"
