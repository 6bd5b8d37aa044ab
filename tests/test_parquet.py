"""Parquet: written from a folder, read by row group with ranged reads, shuffled by row group then
within, sharded across ranks, bad rows following on_error; local files, the layout Hugging Face
datasets writes, and a real S3-compatible server."""

from __future__ import annotations

import json
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from asyncload import AsyncLoader, ImageDecoder, SampleError, image_folder, parquet, write_parquet
from tests.conftest import CLASSES, PER_CLASS, delivered, flat, make_bucket, make_jpeg, setup_s3fs

ALL = {(label, index) for label in range(len(CLASSES)) for index in range(PER_CLASS)}
DECODE = ImageDecoder(32)
GROUP = 5  # rows per row group: 24 rows -> 5 row groups


@pytest.fixture(scope="session")
def parquet_file(jpeg_folder, tmp_path_factory) -> str:
    """The 24 test JPEGs as one Parquet file of 5-row row groups (image folder order)."""
    return write_parquet(image_folder(str(jpeg_folder)), str(tmp_path_factory.mktemp("pq") / "set.parquet"),
                         rows_per_group=GROUP)


@pytest.fixture(scope="session")
def hf_dataset(jpeg_folder, tmp_path_factory):
    """The layout ``datasets`` pushes to the Hub: ``data/<split>-0000i-of-0000n.parquet``, the
    image column a ``{"bytes", "path"}`` struct, the class names in the schema's metadata."""
    root = tmp_path_factory.mktemp("hf")
    (root / "data").mkdir()
    items = list(image_folder(str(jpeg_folder)))
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    features = {"image": {"_type": "Image"}, "label": {"names": list(CLASSES), "_type": "ClassLabel"}}
    schema = pa.schema([("image", image_type), ("label", pa.int64())],
                       metadata={b"huggingface": json.dumps({"info": {"features": features}}).encode()})

    def table(rows):
        images = [{"bytes": open(url, "rb").read(), "path": url.rsplit("/", 1)[-1]} for url, _ in rows]
        return pa.table({"image": pa.array(images, image_type), "label": [label for _, label in rows]}, schema=schema)

    halves = [items[:12], items[12:]]
    for number, rows in enumerate(halves):
        pq.write_table(table(rows), root / "data" / f"train-{number:05d}-of-00002.parquet", row_group_size=4)
    pq.write_table(table(items[:3]), root / "data" / "test-00000-of-00001.parquet")
    return root


@pytest.mark.parametrize("processes", [0, 2])
def test_every_row_once_with_its_label_in_one_ranged_read_per_row_group(parquet_file, processes):
    source = parquet(parquet_file, shuffle_buffer=6)
    assert len(source) == 24 and len(source.urls) == 5 and source.classes == list(CLASSES)
    with AsyncLoader(source, batch_size=5, decode=DECODE, processes=processes) as loader:
        for _ in range(2):
            assert sorted(flat(delivered(loader))) == sorted(ALL)
        stats = loader.stats.as_dict()
    image_bytes = sum(pq.ParquetFile(parquet_file).metadata.row_group(g).column(0).total_compressed_size for g in range(5))
    assert stats["read/items"] == 10  # 5 row groups, each one read, two epochs
    assert stats["read/bytes"] == 2 * image_bytes < 2 * len(open(parquet_file, "rb").read())


def test_a_row_group_larger_than_chunk_bytes_is_still_one_read(parquet_file):
    """A row group is parsed whole: ``chunk_bytes`` (the cache's download size) never splits it."""
    with AsyncLoader(parquet(parquet_file, chunk_bytes=1000), batch_size=6, decode=DECODE) as loader:
        assert sorted(flat(delivered(loader))) == sorted(ALL)
        assert loader.stats.as_dict()["read/items"] == 5


def test_pixels_equal_the_folder_loader(parquet_file, jpeg_folder):
    """Same JPEG bytes, same decode: a row of the file is the image from the folder."""
    with AsyncLoader(parquet(parquet_file), batch_size=24, shuffle=False, decode=DECODE) as loader:
        (parquet_images, parquet_labels), = list(loader)
    with AsyncLoader(image_folder(str(jpeg_folder)), batch_size=24, shuffle=False, decode=DECODE) as loader:
        (images, labels), = list(loader)
    assert torch.equal(parquet_images, images) and torch.equal(parquet_labels, labels)


def test_the_order_is_shuffled_by_row_group_then_within(parquet_file):
    """With a one-row buffer the epoch is whole row groups in a shuffled order; a larger buffer
    mixes rows of neighbouring row groups. Both from (seed, epoch) alone."""
    def order(seed, epoch, buffer):
        with AsyncLoader(parquet(parquet_file, shuffle_buffer=buffer), batch_size=8, seed=seed, decode=DECODE) as loader:
            loader.set_epoch(epoch)
            return flat(delivered(loader))

    storage = sorted(ALL)  # image_folder's order, the file's
    groups = [storage[start : start + GROUP] for start in range(0, 24, GROUP)]
    by_group = order(0, 0, 1)
    cut = 0
    seen = []
    while cut < 24:  # each run of the epoch is one whole row group, in storage order
        group = next(g for g in groups if g[0] == by_group[cut])
        assert by_group[cut : cut + len(group)] == group
        seen.append(groups.index(group))
        cut += len(group)
    assert sorted(seen) == list(range(5)) and seen != list(range(5))
    mixed = order(0, 0, 6)
    assert sorted(mixed) == storage and mixed != by_group
    assert mixed == order(0, 0, 6) and mixed != order(0, 1, 6) and mixed != order(1, 0, 6)


@pytest.mark.parametrize("processes", [0, 2])
def test_ranks_read_disjoint_parts_and_only_their_row_groups(parquet_file, processes):
    source = parquet(parquet_file, shuffle_buffer=3)
    parts = []
    for rank in range(2):
        with AsyncLoader(source, batch_size=4, decode=DECODE, rank=rank, world_size=2, processes=processes) as loader:
            parts.append(flat(delivered(loader)))
            assert loader.stats.as_dict()["read/items"] <= 3  # 12 rows of 5-row groups: at most 3 groups
    assert len(parts[0]) == len(parts[1]) == 12
    assert set(parts[0]).isdisjoint(parts[1]) and set(parts[0]) | set(parts[1]) == ALL


def test_the_hugging_face_layout_with_the_image_struct(hf_dataset):
    train = parquet(str(hf_dataset / "data" / "train-*.parquet"), shuffle_buffer=4)
    assert len(train) == 24 and len(train.files) == 2 and len(train.urls) == 6 and train.classes == list(CLASSES)
    assert repr(train[13][0]) == repr(f"{hf_dataset}/data/train-00001-of-00002.parquet#1")
    with AsyncLoader(train, batch_size=5, decode=DECODE) as loader:
        assert sorted(flat(delivered(loader))) == sorted(ALL)
        assert loader.stats.as_dict()["read/items"] == 6
    everything = parquet(str(hf_dataset))  # the folder: every split
    assert len(everything) == 27 and len(everything.files) == 3


def write_rows(path, images, labels) -> str:
    pq.write_table(pa.table({"image": pa.array(images, pa.binary()), "label": pa.array(labels, pa.int64())}),
                   path, row_group_size=3)
    return str(path)


@pytest.mark.parametrize("processes", [0, 2])
def test_bad_rows_are_skipped_or_raised_naming_the_row(tmp_path, processes):
    """A null image, a null label and bytes that are no image: each fails its row alone."""
    images = [make_jpeg((20 + 25 * i, 40, 230 - 25 * i)) for i in range(PER_CLASS)]
    labels = [0] * PER_CLASS
    images[2], labels[4], images[6] = None, None, b"not an image"
    url = write_rows(tmp_path / "bad.parquet", images, labels)
    source = parquet(url)
    with AsyncLoader(source, batch_size=3, decode=DECODE, on_error="skip", max_failures=3,
                     processes=processes) as loader:
        got = sorted(index for batch in delivered(loader) for _, index in batch)
        failures = sorted((repr(f.item), f.stage) for f in loader.stats.failures)
    assert got == [0, 1, 3, 5, 7]
    assert failures == [(repr(f"{url}#2"), "read"), (repr(f"{url}#4"), "read"), (repr(f"{url}#6"), "decode")]
    with AsyncLoader(source, batch_size=3, shuffle=False, decode=DECODE, processes=processes) as loader:
        with pytest.raises(SampleError, match=r"bad\.parquet#2.*column 'image' is null"):
            list(loader)


@pytest.mark.parametrize("processes", [0, 2])
def test_numeric_columns_come_as_batch_fields(tmp_path, jpeg_folder, processes):
    items = list(image_folder(str(jpeg_folder)))[:6]
    table = pa.table({"image": [open(url, "rb").read() for url, _ in items], "label": [label for _, label in items],
                      "weight": pa.array([0.5 * i for i in range(6)], pa.float32()), "id": list(range(100, 106))})
    pq.write_table(table, tmp_path / "cols.parquet", row_group_size=4)
    source = parquet(str(tmp_path / "cols.parquet"), columns=["weight", "id"])
    with AsyncLoader(source, batch_size=6, shuffle=False, decode=DECODE, processes=processes) as loader:
        (fields, labels), = [({k: v.clone() for k, v in f.items()}, l.clone()) for f, l in loader]
    assert fields["image"].shape == (6, 32, 32, 3) and labels.tolist() == [label for _, label in items]
    assert fields["id"].tolist() == list(range(100, 106)) and fields["weight"].dtype == torch.float32
    assert fields["weight"].tolist() == [0.5 * i for i in range(6)]
    # string columns (lists, not tensors): tests/test_parquet_strings.py


def test_write_parquet_round_trip(parquet_file, jpeg_folder):
    table = pq.read_table(parquet_file)
    items = list(image_folder(str(jpeg_folder)))
    assert table.column("image").to_pylist() == [open(url, "rb").read() for url, _ in items]
    assert table.column("label").to_pylist() == [label for _, label in items]
    assert [pq.ParquetFile(parquet_file).metadata.row_group(g).num_rows for g in range(5)] == [5, 5, 5, 5, 4]


def test_a_missing_column_and_a_missing_pyarrow_say_what_to_do(parquet_file, monkeypatch):
    with pytest.raises(KeyError, match="has no column 'class'.*label=None"):
        parquet(parquet_file, label="class")
    assert parquet(parquet_file, label=None)[0] == parquet(parquet_file)[0][0]
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match=r"pip install 'asyncload\[parquet\]'"):
        parquet(parquet_file)


def test_resume_delivers_the_rest(parquet_file):
    source = parquet(parquet_file, shuffle_buffer=6)
    with AsyncLoader(source, batch_size=4, decode=DECODE, seed=5) as loader:
        whole = delivered(loader)
    with AsyncLoader(source, batch_size=4, decode=DECODE, seed=5) as loader:
        iterator = iter(loader)
        next(iterator), next(iterator)
        state = json.loads(json.dumps(loader.state_dict()))
        iterator.close()
    with AsyncLoader(source, batch_size=4, decode=DECODE, seed=5) as loader:
        loader.load_state_dict(state)
        assert delivered(loader) == whole[2:]


@pytest.fixture(scope="session")
def s3_parquet(s3_options, jpeg_folder) -> str:
    """The test JPEGs written by ``write_parquet`` straight into the bucket (loader's client)."""
    with setup_s3fs(s3_options) as fs:
        make_bucket(fs)
    return write_parquet(image_folder(str(jpeg_folder)), "s3://asyncload-test/parquet/set.parquet",
                         rows_per_group=GROUP, storage_options=s3_options)


@pytest.mark.parametrize("processes", [0, 2])
def test_an_epoch_from_s3_equals_the_local_one_in_one_request_per_row_group(parquet_file, s3_parquet, s3_options,
                                                                            processes):
    def epoch(source, **kwargs):
        with AsyncLoader(source, batch_size=6, decode=DECODE, processes=processes, **kwargs) as loader:
            batches = [(images.clone(), labels.clone()) for images, labels in loader]
            return batches, loader.stats.as_dict()["read/items"]

    expected, _ = epoch(parquet(parquet_file, shuffle_buffer=5))
    got, reads = epoch(parquet("s3://asyncload-test/parquet/", storage_options=s3_options, shuffle_buffer=5),
                       storage_options=s3_options)
    assert reads == 5 and len(got) == len(expected) == 4
    assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(got, expected))


def test_remote_row_groups_are_cached_on_disk(parquet_file, s3_parquet, s3_options, tmp_path):
    source = parquet(s3_parquet, storage_options=s3_options, cache_dir=str(tmp_path / "cache"))
    for _ in range(2):
        with AsyncLoader(source, batch_size=6, decode=DECODE, storage_options=s3_options) as loader:
            assert sorted(flat(delivered(loader))) == sorted(ALL)
    kept = [p for p in (tmp_path / "cache").rglob("*") if p.is_file() and p.stat().st_size == len(open(parquet_file, "rb").read())]
    assert len(kept) == 1  # the file, downloaded once, served both epochs


def test_a_footer_larger_than_the_first_tail_is_read_alone_not_with_the_whole_file(tmp_path, jpeg_folder, monkeypatch):
    """Many row groups make a footer past the 64 KiB first read: its length (the file's last 8
    bytes) says where it starts; the file itself was read whole before, at construction."""
    from asyncload.sources import parquet as parquet_module

    images = [path.read_bytes() for path in sorted(jpeg_folder.rglob("*.jpg"))]
    rows = 1500
    table = pa.table({"image": [images[i % len(images)] for i in range(rows)], "label": list(range(rows))})
    path = tmp_path / "many-groups.parquet"
    pq.write_table(table, path, row_group_size=1)
    size = path.stat().st_size
    footer = int.from_bytes(path.read_bytes()[-8:-4], "little")
    assert footer + 8 > 64 << 10, "the footer does not fit the first read"
    ranges = []
    real = parquet_module.read_ranges

    def spy(urls, starts, ends, *args):
        ranges.extend(zip(starts, ends))
        return real(urls, starts, ends, *args)

    monkeypatch.setattr(parquet_module, "read_ranges", spy)
    source = parquet(str(path))
    assert len(source) == rows and source[rows - 1][1] == rows - 1
    assert (size - footer - 8, size) in ranges and all(start > 0 for start, _ in ranges[:2])
