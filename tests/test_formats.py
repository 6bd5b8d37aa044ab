"""Datasets in other loaders' formats, read as their writers left them: MosaicML Streaming's MDS
shards (``mds``), litdata's ``optimize()`` chunks (``litdata``) and WebDataset tars without an
index (``tar_shards`` of a brace pattern). The fixtures under ``tests/fixtures/formats/`` were
written by the real writers (``tests/fixtures/make_formats.py``); sample i is a JPEG of grey
level ``level(i)`` with label i, caption "sample i" and ``arange(i % 5 + 1)``."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

from asyncload import (AsyncLoader, ImageDecoder, Members, SampleError, StorageError, litdata, mds, mix, parquet,
                       tar_shards)
from asyncload.decode.members import decode_member
from asyncload.sources import brace, shard_learn, writer
from tests.conftest import setup_s3fs, make_bucket
from tests.fixtures.make_formats import SAMPLES, level
from tests.test_listing import silent_endpoint, storage_error  # noqa: F401 (a fixture)

FIXTURES = Path(__file__).parent / "fixtures" / "formats"
PATTERN = "{000000..000002}.tar"
SMALL = ImageDecoder(16)


def source_of(kind: str, root: str | Path, tmp_path: Path, **options):
    """The fixture of ``kind`` at ``root`` (a folder or bucket prefix) as an asyncload source."""
    if kind == "wds":
        options.setdefault("members", "all")
        return tar_shards(f"{root}/{PATTERN}", index_dir=str(tmp_path / "indexes"), **options)
    return {"mds": mds, "litdata": litdata, "litdata_arrow": litdata}[kind](str(root), **options)


def decode_of(kind: str) -> Members:
    """(image, label) for MDS and litdata; the image alone for tars (their .cls labels are known
    up front, so the loader adds them)."""
    return Members("jpg", image=SMALL) if kind == "wds" else Members("image", "label", image=SMALL)


def samples(loader) -> list[tuple[int, int]]:
    """(label, grey level of the image) of every sample delivered, in order."""
    return [(int(label), int(image[8, 8, 0])) for images, labels in loader for image, label in zip(images, labels)]


def assert_each_once_with_its_image(got: list[tuple[int, int]]) -> None:
    assert sorted(label for label, _ in got) == list(range(SAMPLES))
    assert all(abs(grey - level(label)) <= 3 for label, grey in got), got


@pytest.mark.parametrize("processes", [0, 2])
@pytest.mark.parametrize("kind", ["mds", "litdata", "litdata_arrow", "wds"])
def test_every_sample_once_with_its_own_label(kind, processes, tmp_path):
    source = source_of(kind, FIXTURES / kind, tmp_path)
    with AsyncLoader(source, batch_size=5, decode=decode_of(kind), processes=processes, seed=1) as loader:
        got = samples(loader)
    assert_each_once_with_its_image(got)
    assert len(source.urls) == 3  # three shards each: the order is read across them


@pytest.mark.parametrize("processes", [0, 2])
@pytest.mark.parametrize("kind", ["mds", "litdata_arrow"])
def test_image_decoder_given_a_sample_of_columns_says_to_pass_members(kind, processes):
    """An MDS or litdata sample is a dict of columns: ImageDecoder alone fails at the first
    sample naming what it got and what to pass, not with a TypeError from inside the decode."""
    with AsyncLoader(source_of(kind, FIXTURES / kind, None), batch_size=4, decode=ImageDecoder(16),
                     processes=processes) as loader:
        with pytest.raises(SampleError) as raised:
            next(iter(loader))
    text = str(raised.value)
    assert "failed at decode: TypeError: ImageDecoder got a dict ('" in text and "), not an image's bytes" in text
    assert 'pass decode=Members("image", "label", image=ImageDecoder(...))' in text


def test_image_decoder_given_something_else_names_its_type():
    with pytest.raises(TypeError, match="ImageDecoder got a str, not an image's bytes: give it the bytes"):
        SMALL("s3://bucket/a.jpg")


@pytest.mark.parametrize("kind", ["mds", "litdata", "litdata_arrow"])
def test_without_decode_the_image_and_label_columns_make_the_batch(kind):
    with AsyncLoader(source_of(kind, FIXTURES / kind, None), batch_size=6, processes=0) as loader:
        batches = list(loader)
    assert [tuple(images.shape) for images, _ in batches] == [(6, 224, 224, 3)] * 2
    assert sorted(int(label) for _, labels in batches for label in labels) == list(range(SAMPLES))


@pytest.mark.parametrize("kind", ["mds", "litdata"])
def test_every_column_decodes_to_the_value_written(kind):
    source = source_of(kind, FIXTURES / kind, None)
    for shard, url in enumerate(source.urls):
        first, last = int(source.shard_first[shard]), int(source.shard_first[shard + 1])
        got = source.split_chunk(memoryview(Path(url).read_bytes()), 0, list(range(first, last)))
        for sample in got.values():
            i = sample["label"]
            assert sample["caption"] == f"sample {i}" and sample["score"] == i / 4
            assert np.array_equal(sample["arr"], np.arange(i % 5 + 1)) and sample["arr"].dtype == np.int16
            assert sample["image"][:2] == b"\xff\xd8"  # left encoded, for a decode thread
            if kind == "mds":
                assert sample["meta"] == {"i": i}


def test_webdataset_members_decode_by_extension(tmp_path):
    source = source_of("wds", FIXTURES / "wds", tmp_path)
    url = source.urls[1]
    first, last = int(source.shard_first[1]), int(source.shard_first[2])
    got = source.split_chunk(memoryview(Path(url).read_bytes()), 0, list(range(first, last)))
    for index, members in got.items():
        value = {name: decode_member(name, data, SMALL) for name, data in members.items()}
        i = value["cls"]
        assert i == index and value["txt"] == f"sample {i}" and value["json"] == {"i": i}
        assert np.array_equal(value["npy"], np.arange(i % 5 + 1)) and abs(int(value["jpg"][8, 8, 0]) - level(i)) <= 3


def test_members_picks_fields_in_order_with_alternatives_and_names_a_missing_one():
    sample = {"png": b"", "cls": b" 7\n", "txt": "kept as given"}
    assert Members("cls;label", "txt", image=SMALL)(sample) == (7, "kept as given")
    with pytest.raises(KeyError, match="no member 'jpg' or 'webp'"):
        Members("jpg;webp", image=SMALL)(sample)


@pytest.mark.parametrize("kind", ["mds", "litdata", "litdata_arrow", "wds"])
def test_resume_mid_epoch_delivers_the_rest(kind, tmp_path):
    source = source_of(kind, FIXTURES / kind, tmp_path, shuffle_buffer=4)
    settings = dict(batch_size=3, decode=decode_of(kind), seed=2, processes=0)
    with AsyncLoader(source, **settings) as loader:
        whole = samples(loader)
    with AsyncLoader(source, **settings) as loader:
        iterator = iter(loader)
        next(iterator), next(iterator)
        state = json.loads(json.dumps(loader.state_dict()))
        iterator.close()
    with AsyncLoader(source, **settings) as loader:
        loader.load_state_dict(state)
        assert samples(loader) == whole[6:]


@pytest.mark.parametrize("kind, processes", [("mds", 0), ("litdata", 0), ("wds", 0), ("litdata", 2)])
def test_two_ranks_share_the_epoch_in_equal_batch_counts(kind, processes, tmp_path):
    source = source_of(kind, FIXTURES / kind, tmp_path)
    got = []
    for rank in range(2):
        with AsyncLoader(source, batch_size=4, decode=decode_of(kind), rank=rank, world_size=2,
                         processes=processes) as loader:
            got.append(samples(loader))
    assert len(got[0]) == len(got[1]) == SAMPLES // 2
    assert_each_once_with_its_image(got[0] + got[1])


def test_mds_sources_mix_by_weight():
    both = mix({"a": mds(str(FIXTURES / "mds")), "b": mds(str(FIXTURES / "mds"))}, weights={"a": 0.5, "b": 0.5})
    with AsyncLoader(both, batch_size=6, decode=decode_of("mds"), processes=0) as loader:
        batches = list(loader)  # ((images, labels), source ids): the decode's sample, then its source
    got = samples(sample for sample, _ in batches)
    assert len(got) == len(both) and all(abs(grey - level(label)) <= 3 for label, grey in got)
    assert sorted(int(i) for _, ids in batches for i in ids) == [0] * SAMPLES + [1] * SAMPLES
    with AsyncLoader(both, batch_size=6, processes=0) as loader:  # the sources' own (image, label) decode
        assert sorted(int(label) for (_, labels), _ in loader for label in labels) == sorted(list(range(SAMPLES)) * 2)


@pytest.mark.parametrize("kind, field, encoding", [("mds", "column_encodings", "pkl"),
                                                   ("litdata", "data_format", "pickle"),
                                                   ("litdata", "data_format", "no_header_numpy:14"),
                                                   ("litdata", "data_format", "no_header_numpy:16"),
                                                   ("litdata", "data_format", "no_header_numpy:99")])
def test_an_unsupported_encoding_is_refused_at_construction_naming_the_column(kind, field, encoding, tmp_path):
    folder = tmp_path / kind
    shutil.copytree(FIXTURES / kind, folder)
    index = json.loads((folder / "index.json").read_text())
    for part in index["shards"] if kind == "mds" else [index["config"]]:
        part[field][1] = encoding
    (folder / "index.json").write_text(json.dumps(index))
    column = "caption" if kind == "mds" else "label"
    with pytest.raises(ValueError, match=f"column '{column}' has .*'{encoding}'"):
        source_of(kind, folder, tmp_path)


def test_a_sample_whose_offsets_disagree_with_the_index_is_refused(tmp_path):
    folder = tmp_path / "mds"
    shutil.copytree(FIXTURES / "mds", folder)
    index = json.loads((folder / "index.json").read_text())
    index["shards"][0]["samples"] += 1
    (folder / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="shard.00000.mds: its index says 5 samples, the shard's header says 4"):
        mds(str(folder))


def test_brace_patterns_expand_as_webdataset_writes_them():
    assert brace.expand("s3://b/{008..011}.tar") == [f"s3://b/{n:03d}.tar" for n in range(8, 12)]
    assert brace.expand("{a,b}/{0..1}.tar") == ["a/0.tar", "a/1.tar", "b/0.tar", "b/1.tar"]


def test_the_learnt_index_is_kept_and_learnt_again_only_when_a_shard_changes(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "wds"
    shutil.copytree(FIXTURES / "wds", folder)
    learnt: list[str] = []
    real = writer.index_shard
    monkeypatch.setattr(writer, "index_shard", lambda file, url: learnt.append(url) or real(file, url))
    first = tar_shards(f"{folder}/{PATTERN}", cache_dir=str(tmp_path / "cache"))
    assert len(learnt) == 3 and len(list((tmp_path / "cache" / "indexes").glob("learnt-*.json"))) == 1
    said = capsys.readouterr().err
    assert "learning the member table of 3 shards" in said and "learnt 3 shards, 12 samples" in said
    again = tar_shards(f"{folder}/{PATTERN}", cache_dir=str(tmp_path / "cache"))
    assert len(learnt) == 3 and np.array_equal(again.member_offset, first.member_offset)
    assert capsys.readouterr().err == ""  # kept: nothing read, nothing to say
    with open(folder / "000002.tar", "ab") as shard:
        shard.write(bytes(10240))  # another size: the kept table may not describe it
    tar_shards(f"{folder}/{PATTERN}", cache_dir=str(tmp_path / "cache"))
    assert len(learnt) == 6


def test_a_folder_of_tars_without_index_is_learnt_too(tmp_path):
    source = tar_shards(str(FIXTURES / "wds"), index_dir=str(tmp_path))
    assert len(source) == SAMPLES and source.labels.tolist() == list(range(SAMPLES))


def test_a_shard_the_pattern_names_but_storage_lacks_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"1 of 4 shards not found: .*000003\.tar"):
        tar_shards(f"{FIXTURES / 'wds'}/{{000000..000003}}.tar", index_dir=str(tmp_path))


def test_the_processes_of_a_node_learn_the_table_once(tmp_path, monkeypatch):
    """Two at once: the second waits on the first's lock, then reads what it kept."""
    calls: list[int] = []
    real = shard_learn.learn
    gate = threading.Event()

    def slow_learn(*args, **kwargs):
        calls.append(1)
        gate.wait(5)
        return real(*args, **kwargs)

    monkeypatch.setattr(shard_learn, "learn", slow_learn)
    found: list[int] = []
    threads = [threading.Thread(target=lambda: found.append(len(source_of("wds", FIXTURES / "wds", tmp_path))))
               for _ in range(2)]
    for thread in threads:
        thread.start()
    gate.set()
    for thread in threads:
        thread.join(10)
    assert found == [SAMPLES, SAMPLES] and calls == [1]


def upload(s3_options: dict, prefix: str) -> None:
    """The fixtures uploaded to ``s3://asyncload-test/<prefix>/<kind>/``."""
    with setup_s3fs(s3_options) as fs:
        make_bucket(fs)
        for path in FIXTURES.rglob("*"):
            if path.is_file():
                fs.pipe_file(f"asyncload-test/{prefix}/{path.relative_to(FIXTURES)}", path.read_bytes())


@pytest.mark.parametrize("kind, processes", [("mds", 0), ("litdata", 0), ("litdata_arrow", 0), ("wds", 0), ("mds", 2),
                                             ("wds", 2)])
def test_from_s3_every_sample_once_and_the_shards_kept_on_disk(kind, processes, s3_server, s3_options, tmp_path):
    """(Whether epoch 2 asks the bucket anything, e.g. if a shard changed, is the cache's rule.)"""
    prefix = f"formats-{kind}-{processes}"
    upload(s3_options, prefix)
    source = source_of(kind, f"s3://asyncload-test/{prefix}/{kind}", tmp_path, storage_options=s3_options,
                       cache_dir=str(tmp_path / "cache"))
    with AsyncLoader(source, batch_size=5, decode=decode_of(kind), processes=processes, seed=4,
                     storage_options=s3_options) as loader:
        loader.set_epoch(0)
        first = samples(loader)
        loader.set_epoch(0)
        assert samples(loader) == first
    assert_each_once_with_its_image(first)
    kept = [path for path in (tmp_path / "cache").rglob("*") if path.is_file() and path.suffix != ".lock"
            and path.stat().st_size in source.shard_bytes.tolist()]
    assert len(kept) >= len(source.urls)  # every shard downloaded whole, on local disk


@pytest.mark.parametrize("build", [
    lambda options: mds("s3://bucket/mds", storage_options=options, timeout=0.5, retries=0),
    lambda options: litdata("s3://bucket/lit", storage_options=options, timeout=0.5, retries=0),
    lambda options: parquet("s3://bucket/pq/", storage_options=options, timeout=0.5, retries=0),
    lambda options: tar_shards("s3://bucket/{0..3}.tar", storage_options=options, timeout=0.5, retries=0),
], ids=["mds", "litdata", "parquet", "tar-pattern"])
def test_a_silent_endpoint_fails_after_the_timeout_given(silent_endpoint, build):
    options, accepted = silent_endpoint
    error, seconds = storage_error(build, options)
    assert seconds < 20 and "failed after 1 attempt" in str(error) and len(accepted) == 1


@pytest.mark.parametrize("processes", [0, 2])
def test_a_sample_that_does_not_parse_fails_alone_naming_it(tmp_path, processes):
    """Its first column's size runs past the sample: skipped and counted, or raised naming it."""
    folder = tmp_path / "mds"
    shutil.copytree(FIXTURES / "mds", folder)
    shard = bytearray((folder / "shard.00000.mds").read_bytes())
    begin = int.from_bytes(shard[4 * 2:4 * 3], "little")  # sample 1's offset
    shard[begin:begin + 4] = (1 << 20).to_bytes(4, "little")  # its 'arr' column: 1 MiB long
    (folder / "shard.00000.mds").write_bytes(bytes(shard))
    source = mds(str(folder))
    with AsyncLoader(source, batch_size=4, decode=decode_of("mds"), on_error="skip", max_failures=1,
                     processes=processes) as loader:
        got = samples(loader)
        failed = [(f.item, f.stage) for f in loader.stats.failures]
    assert sorted(label for label, _ in got) == [i for i in range(SAMPLES) if i != 1]
    assert failed == [(source[1], "read")] and repr(source[1]) == repr(f"{folder}/shard.00000.mds#1")
    with AsyncLoader(source, batch_size=4, decode=decode_of("mds"), processes=0) as loader:
        with pytest.raises(SampleError, match=r"shard.00000.mds#1' failed at read: ValueError: column 'arr' runs past the sample's 682 bytes"):
            list(loader)


@pytest.mark.parametrize("kind, reader", [("mds", "asyncload.mds"), ("litdata", "asyncload.litdata")])
def test_tar_shards_on_another_format_says_which_reader_reads_it(kind, reader):
    with pytest.raises(ValueError, match=rf"is the index of .*: read it with {reader}\(url\)"):
        tar_shards(str(FIXTURES / kind))


def test_a_list_of_tars_and_a_single_tar_are_shard_sets_too(tmp_path):
    shards = [str(FIXTURES / "wds" / f"00000{n}.tar") for n in (2, 0)]
    both = tar_shards(shards, index_dir=str(tmp_path))
    one = tar_shards(shards[0], index_dir=str(tmp_path))
    assert both.urls == shards and both.labels.tolist() == [8, 9, 10, 11, 0, 1, 2, 3]
    assert one.labels.tolist() == [8, 9, 10, 11]


def test_a_shard_read_that_fails_once_while_learning_is_read_again(tmp_path, monkeypatch):
    real = writer.index_shard
    tries: list[str] = []

    def flaky(file, url):
        tries.append(url)
        if url.endswith("000001.tar") and tries.count(url) == 1:
            raise ConnectionResetError("reset by peer")
        return real(file, url)

    monkeypatch.setattr(writer, "index_shard", flaky)
    source = tar_shards(f"{FIXTURES / 'wds'}/{PATTERN}", index_dir=str(tmp_path), retries=1)
    assert len(source) == SAMPLES and sorted(tries).count(f"{FIXTURES / 'wds'}/000001.tar") == 2
    monkeypatch.setattr(writer, "index_shard", lambda file, url: (_ for _ in ()).throw(PermissionError("denied")))
    with pytest.raises(StorageError, match=r"reading .*000000\.tar failed after 1 attempt: .*denied"):
        tar_shards(f"{FIXTURES / 'wds'}/{PATTERN}", index_dir=str(tmp_path / "other"), retries=1)
