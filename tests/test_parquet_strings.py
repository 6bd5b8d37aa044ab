"""Parquet string columns as batch fields: a ``list`` of ``str`` a column, one per row in the
batch's row order (the tensors' order, also after a skipped row's hole is closed), for one process
and for child processes, shuffled, skipped and resumed; a null string is ``None``."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from asyncload import AsyncLoader, ImageDecoder, image_folder, parquet
from asyncload.batch.buffers import BatchBuffer
from asyncload.batch.layout import SampleLayout
from asyncload.epoch.handout import delivered_rows
from tests.conftest import CLASSES, PER_CLASS, identify

DECODE = ImageDecoder(32)
BAD = 21  # the storage row whose image is corrupt: in the last batch of 5 unshuffled, so it leaves a hole
NO_NAME = (1, 2)  # the (label, index) whose name is null


def name_of(label: int, index: int) -> str | None:
    return None if (label, index) == NO_NAME else f"{CLASSES[label]}/{index}.jpg"


@pytest.fixture(scope="session")
def strings_file(jpeg_folder, tmp_path_factory) -> str:
    """The 24 test JPEGs plus one corrupt image (storage row ``BAD``), 4-row row groups; columns:
    the label, ``name`` (the image's ``class/index.jpg``, null for ``NO_NAME``) and ``number``
    (``100 * label + index``)."""
    items = [(open(url, "rb").read(), label, int(url.rsplit("/", 1)[-1][:-4]))
             for url, label in image_folder(str(jpeg_folder))]
    items.insert(BAD, (b"not an image", 0, 99))
    table = pa.table({
        "image": pa.array([image for image, _, _ in items], pa.binary()),
        "label": pa.array([label for _, label, _ in items], pa.int64()),
        "name": pa.array(["bad" if index == 99 else name_of(label, index) for _, label, index in items], pa.string()),
        "number": pa.array([100 * label + index for _, label, index in items], pa.int32()),
    })
    path = tmp_path_factory.mktemp("pq_strings") / "named.parquet"
    pq.write_table(table, path, row_group_size=4)
    return str(path)


def checked(loader) -> list[list[tuple[int, int]]]:
    """Each batch as the (label, index) of its images; checks that every row's label, number and
    name (a list, in the rows' order) are its image's."""
    batches = []
    for fields, labels in loader:
        seen = [identify(image.numpy()) for image in fields["image"]]
        assert isinstance(fields["name"], list) and len(fields["name"]) == len(seen) == len(labels)
        assert fields["name"] == [name_of(*sample) for sample in seen]
        assert fields["number"].tolist() == [100 * label + index for label, index in seen]
        assert labels.tolist() == [label for label, _ in seen]
        batches.append(seen)
    return batches


ALL = {(label, index) for label in range(len(CLASSES)) for index in range(PER_CLASS)}


@pytest.mark.parametrize("processes", [0, 2])
def test_every_row_gets_its_own_strings_shuffled_with_a_skipped_row(strings_file, processes):
    source = parquet(strings_file, columns=["name", "number"], shuffle_buffer=6)
    assert source.string_columns == ["name"] and source.number_columns == ["number"]
    for seed in range(3):
        with AsyncLoader(source, batch_size=5, decode=DECODE, seed=seed, on_error="skip", max_failures=1, drop_last=False,
                         processes=processes) as loader:
            batches = checked(loader)
            assert [f.stage for f in loader.stats.failures] == ["decode"]
        assert sorted(itertools.chain(*batches)) == sorted(ALL)


@pytest.mark.parametrize("processes", [0, 2])
def test_the_strings_move_with_the_rows_when_a_hole_is_closed(strings_file, processes):
    """Unshuffled, the corrupt row is in the last batch: no position is left to replace it, so its
    row is a hole that the batch's last row fills, strings included."""
    source = parquet(strings_file, columns=["name"])
    with AsyncLoader(source, batch_size=5, shuffle=False, decode=DECODE, on_error="skip", max_failures=1, drop_last=False,
                     processes=processes) as loader:
        batches = [(fields["name"], [identify(image.numpy()) for image in fields["image"]]) for fields, _ in loader]
    names, seen = batches[-1]
    assert seen == [(2, 4), (2, 7), (2, 5), (2, 6)]  # rows 20, 24, 22, 23: row 24 moved into the hole
    assert names == ["fox/4.jpg", "fox/7.jpg", "fox/5.jpg", "fox/6.jpg"]
    assert [name for batch, _ in batches for name in batch][: 5] == [name_of(0, i) for i in range(5)]


def test_resume_delivers_the_rest_with_their_strings(strings_file):
    source = parquet(strings_file, columns=["name", "number"], shuffle_buffer=6)
    options = dict(batch_size=4, decode=DECODE, seed=5, on_error="skip", max_failures=1, drop_last=False)
    with AsyncLoader(source, **options) as loader:
        iterator = iter(loader)
        first = []
        for _ in range(2):
            fields, _ = next(iterator)
            seen = [identify(image.numpy()) for image in fields["image"]]
            assert fields["name"] == [name_of(*sample) for sample in seen]
            first += seen
        state = json.loads(json.dumps(loader.state_dict()))
        iterator.close()
    with AsyncLoader(source, **options) as loader:
        loader.load_state_dict(state)
        rest = list(itertools.chain(*checked(loader)))
    # Which position replaces the skipped row depends on when its failure is seen, so the batches
    # are not compared one for one: every row exactly once, each with its strings.
    assert sorted(first + rest) == sorted(ALL)


def test_string_columns_alone_and_unlabelled_make_a_dict_batch(strings_file):
    source = parquet(strings_file, label=None, columns=["name"])
    with AsyncLoader(source, batch_size=25, shuffle=False, decode=DECODE, on_error="skip", max_failures=1) as loader:
        (batch,) = list(loader)
    assert set(batch) == {"image", "name"} and batch["image"].shape == (24, 32, 32, 3)
    assert batch["name"] == [name_of(*identify(image.numpy())) for image in batch["image"]]
    assert batch["name"].count(None) == 1 and "bad" not in batch["name"]
    assert source.host_fields([BAD, 0]) == {"name": ["bad", "cat/0.jpg"]}


def test_a_column_neither_numbers_nor_strings_and_a_string_label_are_refused(tmp_path):
    table = pa.table({"image": pa.array([b"x"], pa.binary()), "label": ["a"], "tags": pa.array([["a", "b"]])})
    pq.write_table(table, tmp_path / "odd.parquet")
    with pytest.raises(TypeError, match="column 'tags' is list<.*string>: a label must be numbers, a batch field"):
        parquet(str(tmp_path / "odd.parquet"), label=None, columns=["tags"])
    with pytest.raises(TypeError, match="column 'label' is string: a label must be numbers"):
        parquet(str(tmp_path / "odd.parquet"))


@pytest.mark.parametrize("size", [1, 2, 5, 6])
def test_delivered_rows_moves_positions_as_close_holes_moves_rows(size):
    """Every set of holes (but all rows): the positions listed by ``delivered_rows`` are the
    rows' contents after ``BatchBuffer.close_holes``."""
    layout = SampleLayout.of(np.zeros((), np.int64))
    positions = [100 + 7 * row for row in range(size)]
    for count in range(size):
        for holes in itertools.combinations(range(size), count):
            buffer = BatchBuffer(layout, size)
            for row, position in enumerate(positions):
                buffer.write(row, np.int64(position) if row not in holes else np.int64(-1))
            filled = buffer.close_holes(size, set(holes))
            assert delivered_rows(positions, set(holes)) == buffer.arrays[0][:filled].tolist()
            assert -1 not in buffer.arrays[0][:filled]
