"""Parquet ``list<list<float>>`` and ``list<fixed_size_list<float, 4>>`` columns (boxes N x 4)
come as ragged ``[N, 4]`` fields (sources/parquet_nested.py)."""

from __future__ import annotations

import pytest
import torch

from asyncload import AsyncLoader, parquet
from tests.detection import raw_image, rows, sample

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


@pytest.mark.parametrize("processes", [0, 2])
def test_a_list_of_lists_column_is_a_ragged_field_of_rows_of_four(processes, tmp_path):
    samples = [sample(i) for i in range(20)]
    table = pa.table({
        "image": [s["image"].tobytes() for s in samples],
        "boxes": pa.array([s["boxes"].tolist() for s in samples], pa.list_(pa.list_(pa.float32()))),
        "fixed": pa.array([s["boxes"].tolist() for s in samples], pa.list_(pa.list_(pa.float32(), 4))),
        "labels": pa.array([s["labels"] for s in samples], pa.list_(pa.int64())),
        "caption": [s["caption"] for s in samples],
    })
    pq.write_table(table, str(tmp_path / "d.parquet"), row_group_size=8)
    source = parquet(str(tmp_path / "d.parquet"), label=None, columns=["boxes", "fixed", "labels", "caption"])
    with AsyncLoader(source, batch_size=8, shuffle=False, decode=raw_image, processes=processes) as loader:
        got = []
        for batch in loader:
            assert batch["boxes"].layout == torch.jagged and batch["boxes"].values().shape[1:] == (4,)
            for boxes, fixed in zip(batch["boxes"].unbind(), batch["fixed"].unbind()):
                assert torch.equal(fixed, boxes)
            got += rows(batch)  # each row's boxes, labels and caption with its own image
    assert got == list(range(20))


def test_inner_lists_of_other_lengths_are_refused_by_name(tmp_path):
    table = pa.table({"image": [b"x", b"y"], "boxes": pa.array([[[1.0, 2.0]], [[1.0, 2.0, 3.0]]])})
    pq.write_table(table, str(tmp_path / "d.parquet"))
    with pytest.raises(TypeError, match=r"^column 'boxes' is a list of lists of 2 lengths \(2, 3...\): each inner "
                                        r"list must have one length"):
        parquet(str(tmp_path / "d.parquet"), label=None, columns=["boxes"])
