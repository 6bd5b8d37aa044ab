"""litdata's chunks in both layouts its ``optimize()`` writes (see ``sources/litdata.py``), read
as litdata's own reader gives them: the items layout (``litdata``), Arrow rows of bytes and
numbers (``litdata_arrow``) and of lists and dicts compressed by Arrow's zstd
(``litdata_nested_zstd``). The fixtures were written by the real ``optimize()``
(``tests/fixtures/make_formats.py``; ``test_formats_writers.py`` checks they still are)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from asyncload import AsyncLoader, Members, litdata
from asyncload.sources.shard_plan import plan_chunks
from tests.fixtures.make_formats import SAMPLES, litdata_arrow_sample, litdata_nested_sample
from tests.test_formats import SMALL, assert_each_once_with_its_image, samples

FIXTURES = Path(__file__).parent / "fixtures" / "formats"
LAYOUTS = ["litdata", "litdata_arrow", "litdata_nested_zstd"]


def every_sample(source) -> list:
    """Every sample of ``source`` in storage order, each shard cut from its whole file."""
    out = {}
    for shard, url in enumerate(source.urls):
        first, last = int(source.shard_first[shard]), int(source.shard_first[shard + 1])
        out.update(source.split_chunk(memoryview(Path(url).read_bytes()), 0, list(range(first, last))))
    return [out[index] for index in range(len(source))]


def same(ours, theirs) -> bool:
    """Equal values: arrays (NumPy or torch) by dtype and elements, dicts by key, the rest by ==."""
    if isinstance(theirs, dict):
        return isinstance(ours, dict) and ours.keys() == theirs.keys() and all(same(ours[k], theirs[k]) for k in ours)
    if hasattr(theirs, "numpy") or isinstance(theirs, np.ndarray):
        theirs = np.asarray(theirs)
        return isinstance(ours, np.ndarray) and ours.dtype == theirs.dtype and np.array_equal(ours, theirs)
    return type(ours) is type(theirs) and ours == theirs


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_same_samples_as_litdata_streaming_dataset(layout):
    """litdata decodes a jpeg leaf with torchvision (absent here, as it replaces the CPU torch):
    its reader is given one that keeps the bytes, as asyncload does, for a decode thread."""
    pytest.importorskip("litdata")
    from litdata import StreamingDataset
    from litdata.streaming.serializers import JPEGSerializer

    class EncodedJpeg(JPEGSerializer):
        def deserialize(self, data: bytes) -> bytes:
            return bytes(data)

    theirs = StreamingDataset(str(FIXTURES / layout), shuffle=False, serializers={"jpeg": EncodedJpeg()})
    ours = every_sample(litdata(str(FIXTURES / layout)))
    assert len(theirs) == len(ours) == SAMPLES
    for index, sample in enumerate(ours):
        assert same(sample, theirs[index]), (index, sample, theirs[index])


@pytest.mark.parametrize("layout, written", [("litdata_arrow", litdata_arrow_sample),
                                             ("litdata_nested_zstd", litdata_nested_sample)])
def test_arrow_rows_read_as_the_writer_was_given_them(layout, written):
    source = litdata(str(FIXTURES / layout))
    assert source.arrow_shards == {0, 1, 2}
    assert every_sample(source) == [written(i) for i in range(SAMPLES)]


@pytest.mark.parametrize("processes", [0, 2])
def test_nested_arrow_rows_through_the_loader_every_sample_once(processes):
    source = litdata(str(FIXTURES / "litdata_nested_zstd"))
    with AsyncLoader(source, batch_size=5, decode=Members("label", "tags", "meta"), processes=processes,
                     seed=3) as loader:
        got = [(int(label), tags, {"i": int(i), "odd": bool(odd)}) for labels, tags_list, meta in loader
               for label, tags, i, odd in zip(labels, tags_list, meta["i"], meta["odd"])]
    assert sorted(got, key=lambda row: row[0]) == [(i, *[litdata_nested_sample(i)[k] for k in ("tags", "meta")])
                                                   for i in range(SAMPLES)]


def test_the_rows_of_a_chunk_are_one_read_however_small_chunk_bytes():
    source = litdata(str(FIXTURES / "litdata_arrow"))
    chunks = plan_chunks(source, np.arange(SAMPLES), chunk_bytes=1)
    assert [(Path(c.url).name, c.indices) for c in chunks] == [
        (f"chunk-0-{n}.bin", list(range(4 * n, 4 * n + 4))) for n in range(3)]


def test_arrow_rows_chunk_bytes_under_a_row_still_deliver_each_once(tmp_path):
    with AsyncLoader(litdata(str(FIXTURES / "litdata_arrow"), chunk_bytes=1), batch_size=5,
                     decode=Members("image", "label", image=SMALL), processes=0, seed=1) as loader:
        assert_each_once_with_its_image(samples(loader))


@pytest.mark.parametrize("level, written", [("batch", "'batch'"), ("sample", "'sample'"), (None, "'chunk'")])
def test_zstd_of_the_items_layout_is_refused_naming_compression_and_level(level, written, tmp_path):
    folder = tmp_path / "zstd"
    shutil.copytree(FIXTURES / "litdata", folder)
    index = json.loads((folder / "index.json").read_text())
    index["config"].update(compression="zstd", compression_level=level)
    (folder / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"compression='zstd' \(compression_level {written}\): asyncload reads "
                                         r"litdata's items chunks without compression, and Arrow rows"):
        litdata(str(folder))


def test_a_leaf_format_read_only_in_arrow_rows_is_refused_where_a_chunk_has_items(tmp_path):
    """The nested fixture's ``tags`` leaf is litdata's ``json``: read from Arrow rows, refused in
    an items chunk (its byte layout changes between litdata versions)."""
    folder = tmp_path / "items"
    shutil.copytree(FIXTURES / "litdata_nested_zstd", folder)
    offsets = [24 + 20 * n for n in range(5)]  # 4 items of 5 leaves' sizes each, no Arrow trailer
    (folder / "chunk-0-1.bin").write_bytes(np.array([4, *offsets], "<u4").tobytes() + bytes(80))
    with pytest.raises(ValueError, match="column 'tags' has data format 'json', which asyncload does not read in "
                                         "litdata's items layout"):
        litdata(str(folder))


def test_arrow_rows_that_do_not_parse_fail_each_sample_naming_it(tmp_path):
    folder = tmp_path / "bad"
    shutil.copytree(FIXTURES / "litdata_arrow", folder)
    chunk = folder / "chunk-0-2.bin"
    data = bytearray(chunk.read_bytes())
    start = 4 * 6
    data[start:start + 64] = bytes(64)  # the IPC file's magic and first message, zeroed
    chunk.write_bytes(bytes(data))
    source = litdata(str(folder))
    got = every_sample(source)
    assert all(isinstance(sample, dict) for sample in got[:8])
    assert all(isinstance(sample, Exception) for sample in got[8:])
    with AsyncLoader(source, batch_size=4, decode=Members("image", "label", image=SMALL), processes=0,
                     shuffle=False, on_error="skip", max_failures=4) as loader:
        labels = sorted(int(label) for _, batch in loader for label in batch)
        failed = [f"{failure.item!r}: {failure.error}" for failure in loader.stats.failures]
    assert labels == list(range(8))
    assert len(failed) == 4 and all("chunk-0-2.bin" in text for text in failed), failed
