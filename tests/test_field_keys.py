"""A dict sample's fields are matched by key, never by position (issue 37): a sample whose dict
has the same keys in another order (parsed JSON keeps the order of its text) is the same sample,
each value written into its own field; another key set is a ``SampleError`` naming both. In
both modes, on the fast path (fixed-shape fields) and the ragged one (values aside), nested too."""

from __future__ import annotations

import json

import numpy as np
import pytest

from asyncload import AsyncLoader, Members, SampleError, tar_shards

MODES = [0, 2]
N = 8


def loader_of(decode, processes: int, n: int = N, **options) -> AsyncLoader:
    return AsyncLoader(list(range(n)), batch_size=4, shuffle=False, read=False, decode=decode,
                       processes=processes, **options)


def fixed_in_turns(index: int) -> dict:
    """Sample 0 (which teaches the layout) has ``b`` first; every other sample ``a`` first."""
    a, b = np.int64(index), np.int64(-index)
    return {"b": b, "a": a} if index % 2 == 0 else {"a": a, "b": b}


@pytest.mark.parametrize("processes", MODES)
def test_fixed_fields_of_a_dict_in_another_key_order_are_written_by_key(processes):
    with loader_of(fixed_in_turns, processes) as loader:
        batches = list(loader)
    assert [list(batch) for batch in batches] == [["b", "a"], ["b", "a"]]  # the first sample's order
    assert [batch["a"].tolist() for batch in batches] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [batch["b"].tolist() for batch in batches] == [[0, -1, -2, -3], [-4, -5, -6, -7]]


def nested_in_turns(index: int) -> dict:
    """Nested dicts, the inner and the outer one each in either order."""
    meta = {"w": np.int32(index), "h": np.int32(10 * index)}
    if index % 2:
        meta = {"h": meta["h"], "w": meta["w"]}
    image = np.full((2, 2), index, np.uint8)
    return {"meta": meta, "image": image} if index % 3 else {"image": image, "meta": meta}


@pytest.mark.parametrize("processes", MODES)
def test_nested_dicts_in_another_key_order_are_written_by_key(processes):
    with loader_of(nested_in_turns, processes) as loader:
        batches = list(loader)
    assert list(batches[0]) == ["image", "meta"] and list(batches[0]["meta"]) == ["w", "h"]
    assert sum((batch["meta"]["w"].tolist() for batch in batches), []) == list(range(N))
    assert sum((batch["meta"]["h"].tolist() for batch in batches), []) == [10 * i for i in range(N)]
    assert sum((batch["image"][:, 0, 0].tolist() for batch in batches), []) == list(range(N))


def ragged_in_turns(index: int) -> dict:
    """Values that go aside (a str) and a ragged field beside fixed ones, in three key orders."""
    values = {"name": f"s{index}", "boxes": np.full((index % 3, 4), index, np.float32),
              "meta": {"id": np.int64(index), "tag": f"t{index}"}}
    order = [("name", "boxes", "meta"), ("meta", "name", "boxes"), ("boxes", "meta", "name")][index % 3]
    if index % 2:
        values["meta"] = {"tag": values["meta"]["tag"], "id": values["meta"]["id"]}
    return {key: values[key] for key in order}


@pytest.mark.parametrize("processes", MODES)
def test_ragged_and_python_values_in_another_key_order_are_written_by_key(processes):
    with loader_of(ragged_in_turns, processes, n=12) as loader:
        batches = list(loader)
    assert list(batches[0]) == ["name", "boxes", "meta"] and list(batches[0]["meta"]) == ["id", "tag"]
    assert sum((batch["name"] for batch in batches), []) == [f"s{i}" for i in range(12)]
    assert sum((batch["meta"]["tag"] for batch in batches), []) == [f"t{i}" for i in range(12)]
    assert sum((batch["meta"]["id"].tolist() for batch in batches), []) == list(range(12))
    boxes = [rows.tolist() for batch in batches for rows in batch["boxes"].unbind()]
    assert boxes == [[[float(i)] * 4] * (i % 3) for i in range(12)]


def other_keys_at(index: int) -> dict:
    if index == 5:
        return {"a": np.int64(index), "c": np.int64(0)}
    return {"a": np.int64(index), "b": np.int64(-index)}


def other_inner_keys_at(index: int) -> dict:
    meta = {"w": index, "h": index} if index != 6 else {"w": index, "depth": index}
    return {"name": f"s{index}", "meta": meta}


@pytest.mark.parametrize("processes", MODES)
@pytest.mark.parametrize(("decode", "message"), [
    (other_keys_at, r"^sample 5 failed at decode: FieldMismatch: the sample's structure differs from the samples' "
                    r"before it at 'sample': a dict of \['a', 'c'\] there, where they had a dict of \['a', 'b'\]$"),
    (other_inner_keys_at, r"^sample 6 failed at decode: FieldMismatch: the sample's structure differs from the "
                          r"samples' before it at 'meta': a dict of \['depth', 'w'\] there, where they had a dict "
                          r"of \['h', 'w'\]$"),
])
def test_another_key_set_names_the_sample_and_both_key_sets(decode, message, processes):
    with loader_of(decode, processes) as loader:
        with pytest.raises(SampleError, match=message):
            list(loader)


@pytest.mark.parametrize("processes", MODES)
def test_another_key_set_is_skipped_and_counted_with_on_error_skip(processes):
    with loader_of(other_keys_at, processes, on_error="skip", max_failures=1) as loader:
        got = sorted(sum((batch["a"].tolist() for batch in loader), []))
        failures = [failure.item for failure in loader.stats.failures]
    assert got == [i for i in range(N) if i != 5] and failures == [5]


@pytest.mark.parametrize("processes", MODES)
def test_json_members_with_keys_in_either_order_keep_widths_and_heights(processes, tmp_path):
    """The case seen: annotations whose objects come with their keys in either order, decoded
    as parsed JSON (the fast path: every value a number)."""
    webdataset = pytest.importorskip("webdataset")
    path = str(tmp_path / "000000.tar")
    with webdataset.TarWriter(path) as writer:
        for index in range(10):
            size = {"width": 100 + index, "height": 200 + index}
            if index % 3 == 1:
                size = {"height": size["height"], "width": size["width"]}
            writer.write({"__key__": f"s{index:04d}", "json": json.dumps(size).encode()})
    with AsyncLoader(tar_shards(path, members="all", index_dir=str(tmp_path / "indexes")), batch_size=4,
                     shuffle=False, decode=Members("json"), processes=processes) as loader:
        batches = list(loader)
    assert sum((batch["width"].tolist() for batch in batches), []) == [100 + i for i in range(10)]
    assert sum((batch["height"].tolist() for batch in batches), []) == [200 + i for i in range(10)]
