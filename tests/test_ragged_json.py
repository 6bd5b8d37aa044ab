"""Parsed JSON in a sample (``Members("json")`` of WebDataset tars, COCO-style annotations):
lists of varying length, of numbers, strings or dicts, come as each row's list, not as structure."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from asyncload import AsyncLoader, Members, SampleError, tar_shards

webdataset = pytest.importorskip("webdataset")


def annotation(index: int) -> dict:
    count = index % 3
    return {"boxes": [[index, 0.5, 1, 1]] * count, "labels": [index] * count, "tags": [f"t{k}" for k in range(count)],
            "objects": [{"bbox": [index, 0, 2, 2], "category_id": k} for k in range(count)], "id": index}


def decode_image_and_json(members: dict) -> tuple:
    return Members("npy", "json")(members)


@pytest.mark.parametrize("processes", [0, 2])
def test_json_members_of_a_webdataset_tar_come_as_each_rows_lists(processes, tmp_path):
    path = str(tmp_path / "shard-000000.tar")
    with webdataset.TarWriter(path) as writer:
        for index in range(13):
            image = io.BytesIO()
            np.save(image, np.full((2, 2), index, np.uint8))
            writer.write({"__key__": f"{index:06d}", "npy": image.getvalue(),
                          "json": json.dumps(annotation(index)).encode()})
    with AsyncLoader(tar_shards(path, members="all"), batch_size=4, shuffle=False, decode=decode_image_and_json,
                     processes=processes) as loader:
        got = []
        for images, meta in loader:
            assert meta["id"].tolist() == images[:, 0, 0].tolist()
            for row, index in enumerate(meta["id"].tolist()):
                assert {key: meta[key][row] for key in ("boxes", "labels", "tags", "objects")} == {
                    key: value for key, value in annotation(index).items() if key != "id"}
                got.append(index)
    assert got == list(range(13))


def test_a_structure_mismatch_names_the_first_place_that_differs():
    def decode(index: int) -> dict:
        return {"x": np.zeros(2), "pair": (np.zeros(1), np.zeros(1)) if index == 5 else (np.zeros(1),)}
    with AsyncLoader(list(range(8)), batch_size=4, shuffle=False, read=False, decode=decode, processes=0) as loader:
        with pytest.raises(SampleError, match=r"^sample 5 failed at decode: FieldMismatch: the sample's structure "
                                              r"differs from the samples' before it at 'pair\[1\]': a value there, "
                                              r"where they had nothing$"):
            list(loader)
