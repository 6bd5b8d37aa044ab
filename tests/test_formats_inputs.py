"""The formats' readers against input they must refuse or read right anyway (the sibling of
``test_formats.py``, on the same fixtures): hostile or impossible index values, older writers'
indexes, brace patterns as ``braceexpand`` expands them, shards named twice or rewritten in
place, interleaved tar members, the learnt index's lock, secrets in messages, DDP padding."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import tarfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncload import AsyncLoader, litdata, mds, tar_shards
from asyncload.cache import files
from asyncload.sources import litdata as litdata_source
from asyncload.sources import brace, shard_learn
from tests.fixtures.make_formats import SAMPLES, old_litdata
from tests.test_formats import FIXTURES, PATTERN, assert_each_once_with_its_image, decode_of, samples, source_of


@pytest.mark.parametrize("kind", ["mds", "wds"])
def test_ranks_that_do_not_divide_the_count_are_padded_as_distributed_sampler(kind, tmp_path):
    """12 samples over 5 ranks: 3 each (DistributedSampler's padding repeats 3 samples), so every
    rank runs the same number of batches and DDP's collectives stay in step."""
    source = source_of(kind, FIXTURES / kind, tmp_path)
    got = []
    for rank in range(5):
        with AsyncLoader(source, batch_size=2, decode=decode_of(kind), rank=rank, world_size=5, processes=0,
                         seed=3) as loader:
            batches = list(loader)
            assert len(batches) == len(loader) == 2
        got.append([int(label) for _, labels in batches for label in labels])
    labels = [label for part in got for label in part]
    assert [len(part) for part in got] == [3] * 5
    assert sorted(set(labels)) == list(range(SAMPLES)) and len(labels) - len(set(labels)) == 3


def test_litdata_numpy_arrays_of_every_fixed_size_dtype_decode():
    for number, name in enumerate(["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                                   "float16", "float32", "float64", "complex64", "complex128", "bool"]):
        values = np.arange(6).astype(name).reshape(2, 3)
        assert np.array_equal(litdata_source.column_decoder(f"no_header_numpy:{number}")(values.tobytes()), values.ravel())
        header = np.array([number, 2, 2, 3], "<u4").tobytes()
        got = litdata_source.column_decoder("numpy")(header + values.tobytes())
        assert got.dtype == values.dtype and np.array_equal(got, values)
    with pytest.raises(ValueError, match=r"numpy dtype number 14 \(object\)"):
        litdata_source.column_decoder("numpy")(np.array([14, 1, 1], "<u4").tobytes() + bytes(8))


def _set_samples(shard, value):
    shard["samples"] = value


def _set_bytes(shard, value):
    shard["raw_data"]["bytes"] = value


def _drop_last_encoding(shard, _):
    shard["column_encodings"].pop()


def _negative_size(shard, _):
    shard["column_sizes"][1] = -4


@pytest.mark.parametrize("edit, value, message", [
    (_set_samples, 2**34, r"field 'samples' must be an integer in \[1, 756\] .* got 17179869184"),
    (_set_samples, 0, r"field 'samples' must be an integer in \[1, 756\]"),
    (_set_samples, -3, r"field 'samples' must be an integer in \[1, 756\]"),
    (_set_samples, "4", r"field 'samples' must be an integer"),
    (_set_bytes, 10**15, r"field 'raw_data.bytes' must be an integer in \[0, 2\*\*32\]"),
    (_set_bytes, 3100, r"shard.00000.mds: its index says 3100 bytes, the storage holds 3034"),
    (_drop_last_encoding, None, r"field 'column_names' column_names, column_encodings and column_sizes must be lists "
                                r"of one entry per column"),
    (_negative_size, None, r"field 'column_sizes' has an entry -4"),
])
def test_an_mds_index_with_impossible_values_is_refused_before_allocating(edit, value, message, tmp_path):
    """A hostile or corrupt index: refused naming the shard and field (2**34 samples would have
    asked NumPy for 128 GiB first)."""
    folder = tmp_path / "mds"
    shutil.copytree(FIXTURES / "mds", folder)
    index = json.loads((folder / "index.json").read_text())
    edit(index["shards"][0], value)
    (folder / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=message):
        mds(str(folder))


@pytest.mark.parametrize("items, message", [(2**34, "chunk-0-2.bin: its index says 17179869184 samples, more than"),
                                            (-1, "shard 2: field 'chunk_size' must be an integer >= 0, got -1"),
                                            (4.5, "shard 2: field 'chunk_size' must be an integer >= 0, got 4.5")])
def test_a_litdata_chunk_size_its_offset_table_cannot_hold_is_refused(items, message, tmp_path):
    folder = tmp_path / "lit"
    shutil.copytree(FIXTURES / "litdata", folder)
    index = json.loads((folder / "index.json").read_text())
    index["chunks"][2]["chunk_size"] = items
    (folder / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=message):
        litdata(str(folder))


@pytest.mark.parametrize("kind, name, why", [("mds", "simplecache::s3://b/x.mds", "another protocol or store"),
                                            ("mds", "../../etc/x.mds", "climbs out of the index's folder"),
                                            ("litdata", "/etc/x.bin", "another location")])
def test_a_shard_file_outside_the_index_folder_is_refused(kind, name, why, tmp_path):
    """The one path-safety rule of every index (shard_index.shard_url), ``::`` chains included."""
    folder = tmp_path / kind
    shutil.copytree(FIXTURES / kind, folder)
    index = json.loads((folder / "index.json").read_text())
    if kind == "mds":
        index["shards"][1]["raw_data"]["basename"] = name
    else:
        index["chunks"][1]["filename"] = name
    (folder / "index.json").write_text(json.dumps(index))
    field = "raw_data.basename" if kind == "mds" else "filename"
    with pytest.raises(ValueError, match=f"shard 1: field '{field}' .* points to|shard 1: field '{field}' .* climbs") as caught:
        source_of(kind, folder, tmp_path)
    assert why in str(caught.value) and "allow_external_shards" not in str(caught.value)


def test_litdata_chunks_indexed_by_older_versions_are_read_whole(tmp_path):
    """Older litdata writes ``chunk_bytes`` without the offset table: the sizes come from the
    listing, so every sample is still read."""
    source = litdata(old_litdata(str(tmp_path / "old")))
    assert source.shard_bytes.tolist() == [(FIXTURES / "litdata" / f"chunk-0-{n}.bin").stat().st_size for n in range(3)]
    with AsyncLoader(source, batch_size=5, decode=decode_of("litdata"), processes=0) as loader:
        assert_each_once_with_its_image(samples(loader))


def test_a_chunk_shorter_than_its_offset_table_says_is_refused(tmp_path):
    folder = tmp_path / "lit"
    shutil.copytree(FIXTURES / "litdata", folder)
    chunk = folder / "chunk-0-1.bin"
    chunk.write_bytes(chunk.read_bytes()[:-10])
    with pytest.raises(ValueError, match=r"chunk-0-1.bin: its offset table .* runs past the shard's 2732 bytes"):
        litdata(str(folder))


BRACE_CASES = ["{0..3}", "{00..03}", "{1..010}", "{0..10}", "{a,{b,c}}", "x{a,b}{,.bak}", "{0..6..2}", "{a..c}",
               "{a}", "{}", "{3..0}", "{-1..1}", "{09..11}", r"\{a,b\}", "{c..a}", "{a..e..2}", "p{2.{5..7},3.{2,3}}"]


@pytest.mark.parametrize("pattern", BRACE_CASES)
def test_brace_patterns_name_what_braceexpand_names(pattern):
    braceexpand = pytest.importorskip("braceexpand").braceexpand
    assert brace.expand(pattern) == list(braceexpand(pattern))


@pytest.mark.parametrize("pattern", BRACE_CASES + ["{0..9..4}", "{9..0..4}", "{Z..a}", "{a..Z..3}", "{{a,b}}", "{a,}",
                                     "{a,b}{1..3}{x,{y,z}}", r"a\,b{c\,d,e}", "{,}", "{0..-3}", "{-0..2}", "{a..A}"])
def test_a_patterns_count_is_what_braceexpand_gives(pattern):
    """The bound is checked on this count, so it must be exactly braceexpand's."""
    braceexpand = pytest.importorskip("braceexpand").braceexpand
    assert brace.count(pattern) == len(list(braceexpand(pattern)))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(alphabet="{},.a1-\\", max_size=14))
def test_any_patterns_count_or_refusal_is_braceexpands(pattern):
    braceexpand = pytest.importorskip("braceexpand").braceexpand
    try:
        expected = len(list(braceexpand(pattern)))
    except ValueError:
        with pytest.raises(ValueError, match="Unbalanced braces"):
            brace.count(pattern)
        return
    assert brace.count(pattern) == expected


@pytest.mark.parametrize("pattern", ["s3://b/train/{0000000..9999999}.tar", "s3://b/{0..999999999}.tar",
                                     "s3://b/{0..99999}/{0..99999}.tar"])
def test_a_pattern_past_the_bound_is_refused_before_it_is_expanded(pattern, tmp_path):
    """One digit too many took 42 s and 1.6 GB before any shard was listed; ten more, MemoryError.
    Counted from the parse: refused at once, before any listing (the bucket does not exist)."""
    count = {"s3://b/train/{0000000..9999999}.tar": "10,000,000", "s3://b/{0..999999999}.tar": "1,000,000,000",
             "s3://b/{0..99999}/{0..99999}.tar": "10,000,000,000"}[pattern]
    with pytest.raises(ValueError, match=rf"^tar_shards: the brace pattern '{re.escape(pattern)}' names {count} shard "
                                         r"URLs, more than max_shards=1,000,000: a typo in a range\? If not, pass "
                                         r"tar_shards\(\.\.\., max_shards=N\) with a larger N$"):
        tar_shards(pattern, index_dir=str(tmp_path))


def test_the_bound_counts_every_pattern_of_a_list_and_is_adjustable(tmp_path):
    patterns = [f"{FIXTURES}/wds/{{000000..000001}}.tar", f"{FIXTURES}/wds/000002.tar"]
    with pytest.raises(ValueError, match=r"the brace pattern '.*/wds/\{000000\.\.000001\}.tar' names 2 shard "
                                         r"URLs \(3 with the 1 others\), more than max_shards=2"):
        tar_shards(patterns, index_dir=str(tmp_path), max_shards=2)
    assert len(tar_shards(patterns, index_dir=str(tmp_path), max_shards=3).urls) == 3
    with pytest.raises(ValueError, match=r"names 3 shard URLs, more than max_shards=1"):
        tar_shards(f"{FIXTURES}/wds/{PATTERN}", index_dir=str(tmp_path), max_shards=1)


@pytest.mark.parametrize("urls", [f"{FIXTURES}/wds/{{000000,{{000000,000001}}}}.tar",
                                  [f"{FIXTURES}/wds/000000.tar", f"{FIXTURES}/wds/000001.tar", f"{FIXTURES}/wds/000000.tar"]])
def test_a_shard_named_twice_is_refused_naming_it(urls, tmp_path):
    with pytest.raises(ValueError, match=r"1 shard URL\(s\) named more than once .*wds/000000.tar"):
        tar_shards(urls, index_dir=str(tmp_path))


def test_a_tar_whose_samples_interleave_is_refused_naming_the_shard_and_key(tmp_path):
    shard = tmp_path / "000000.tar"
    write_tar(shard, [("a.jpg", b"1"), ("b.jpg", b"2"), ("a.cls", b"1"), ("b.cls", b"2")])
    with pytest.raises(ValueError, match=r"000000.tar: the members of sample 'a' are not consecutive .*'a.cls'"):
        tar_shards(str(shard), index_dir=str(tmp_path / "indexes"))


def write_tar(path: Path, members: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_a_shard_rewritten_with_the_same_size_is_learnt_again(tmp_path):
    """Tars are 10 KiB records: a regenerated dataset often has the same sizes. The listing's
    ETag/mtime is kept beside each size, so the kept table is not used for new contents."""
    shard = tmp_path / "000000.tar"
    write_tar(shard, [("a.jpg", b"x" * 100), ("a.cls", b"1")])
    first = tar_shards(str(shard), index_dir=str(tmp_path / "indexes"))
    size = shard.stat().st_size
    write_tar(shard, [("a.jpg", b"y" * 100), ("a.cls", b"7")])
    assert shard.stat().st_size == size
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 1_000_000_000))  # a coarse clock
    again = tar_shards(str(shard), index_dir=str(tmp_path / "indexes"))
    assert first.labels.tolist() == [1] and again.labels.tolist() == [7]


def test_a_folder_of_tars_is_read_at_its_own_level_only(tmp_path):
    """A ``val/`` or an old copy below the folder does not join the shard set unasked."""
    folder = tmp_path / "train"
    (folder / "old").mkdir(parents=True)
    shutil.copy(FIXTURES / "wds" / "000000.tar", folder)
    shutil.copy(FIXTURES / "wds" / "000001.tar", folder / "old")
    source = tar_shards(str(folder), index_dir=str(tmp_path / "indexes"))
    assert [Path(url).name for url in source.urls] == ["000000.tar"] and source.labels.tolist() == [0, 1, 2, 3]
    with pytest.raises(FileNotFoundError, match="no .tar shard directly in .* subfolders are not searched"):
        tar_shards(str(tmp_path), index_dir=str(tmp_path / "indexes"))


def test_a_missing_shard_is_named_without_its_signature(tmp_path):
    url = f"{FIXTURES}/wds/000009.tar?X-Amz-Signature=0123456789abcdef"
    with pytest.raises(FileNotFoundError, match=r"1 of 2 shards not found: .*wds/000009.tar\?X-Amz-Signature=\*\*\*") as caught:
        tar_shards([f"{FIXTURES}/wds/000000.tar", url], index_dir=str(tmp_path))
    assert "0123456789abcdef" not in str(caught.value)


def test_a_learner_that_stopped_is_waited_for_no_longer_than_the_timeout(tmp_path, capsys):
    """A rank stopped while it holds the lock (SIGSTOP, a hung disk) keeps its flock but stops
    beating: the others learn the table themselves after ``timeout``, not never."""
    urls = shard_learn.expanded(f"{FIXTURES}/wds/{PATTERN}")
    path = Path(shard_learn.index_path(urls, str(tmp_path / "indexes"), None) + ".lock")
    path.parent.mkdir(parents=True)
    holder = files.try_lock(path)
    try:
        source = tar_shards(f"{FIXTURES}/wds/{PATTERN}", index_dir=str(tmp_path / "indexes"), timeout=0.3)
    finally:
        os.close(holder)
    assert len(source) == SAMPLES
    assert "showed no progress for 0.3 s: learning it here too" in capsys.readouterr().err


def test_a_learner_slower_than_the_timeout_is_waited_for_while_it_beats(tmp_path, monkeypatch):
    calls: list[int] = []
    real = shard_learn.learn

    def slow_learn(*args, **kwargs):
        calls.append(1)
        time.sleep(2.5)  # longer than the timeout: its heartbeat keeps the other waiting
        return real(*args, **kwargs)

    monkeypatch.setattr(shard_learn, "learn", slow_learn)
    found: list[int] = []
    build = lambda: found.append(len(source_of("wds", FIXTURES / "wds", tmp_path, timeout=1.5)))  # noqa: E731
    threads = [threading.Thread(target=build) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert found == [SAMPLES, SAMPLES] and calls == [1]


def test_on_s3_a_folder_is_read_at_its_level_and_a_rewritten_shard_learnt_again(s3_server, s3_options, tmp_path):
    """The listing rules on a real bucket: the prefix's own tars only; ETags tell a rewrite."""
    from tests.conftest import make_bucket, setup_s3fs

    prefix = "asyncload-test/formats-inputs/train"
    with setup_s3fs(s3_options) as fs:
        make_bucket(fs)
        fs.pipe_file(f"{prefix}/000000.tar", (FIXTURES / "wds" / "000000.tar").read_bytes())
        fs.pipe_file(f"{prefix}/old/000001.tar", (FIXTURES / "wds" / "000001.tar").read_bytes())
    build = lambda: tar_shards(f"s3://{prefix}", storage_options=s3_options, index_dir=str(tmp_path))  # noqa: E731
    first = build()
    assert [url.rsplit("/", 1)[1] for url in first.urls] == ["000000.tar"] and first.labels.tolist() == [0, 1, 2, 3]
    shard = tmp_path / "rewritten.tar"
    write_tar(shard, [("s0000.jpg", b"x"), ("s0000.cls", b"9")])
    data = shard.read_bytes()
    with setup_s3fs(s3_options) as fs:
        size = (FIXTURES / "wds" / "000000.tar").stat().st_size
        fs.pipe_file(f"{prefix}/000000.tar", data + bytes(size - len(data)))  # the same size, new contents
    again = build()
    assert again.labels.tolist() == [9]
