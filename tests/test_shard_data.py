"""What a shard or an index holds, taken as WebDataset and MosaicML Streaming take it, or refused
naming where and why (issue 37): member extensions in any case, a member twice in a sample, a tar
cut short while its layout is learnt, an MDS index naming a shard twice or a column type it cannot
hold, and a decoded tensor a batch cannot hold."""

from __future__ import annotations

import io
import json
import shutil
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

from asyncload import AsyncLoader, Members, SampleError, StorageError, mds, tar_shards
from tests.test_formats import FIXTURES

webdataset = pytest.importorskip("webdataset")
MODES = [0, 2]


def jpeg(level: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 8), (level, level, level)).save(out, "JPEG", quality=95)
    return out.getvalue()


@pytest.mark.parametrize("processes", MODES)
def test_upper_case_extensions_are_members_of_their_lower_case_name(processes, tmp_path):
    """WebDataset lower-cases a member's suffix (``group_by_keys(lcase=True)``): ``a.JPG`` is
    the sample's ``jpg``, decoded as an image, also by the default decode (images only)."""
    path = str(tmp_path / "000000.tar")
    with webdataset.TarWriter(path) as writer:
        for index in range(6):
            writer.write({"__key__": f"s{index}", "JPG" if index % 2 else "jpg": jpeg(40 * index),
                          "Cls": str(index).encode()})
    source = tar_shards(path, members="all", index_dir=str(tmp_path / "indexes"))
    assert source.extensions == ["cls", "jpg"]
    with AsyncLoader(source, batch_size=3, shuffle=False, decode=Members("jpg"),
                     processes=processes) as loader:  # the labels: the .Cls members
        batches = [(images[:, 0, 0, 0].tolist(), labels.tolist()) for images, labels in loader]
    levels = [level for images, _ in batches for level in images]
    assert [label for _, labels in batches for label in labels] == list(range(6))
    assert all(abs(level - 40 * index) <= 2 for index, level in enumerate(levels)), levels
    with AsyncLoader(tar_shards(path, index_dir=str(tmp_path / "indexes")), batch_size=3, shuffle=False,
                     processes=processes) as loader:  # members="image": the image member, however spelt
        assert [labels.tolist() for _, labels in loader] == [[0, 1, 2], [3, 4, 5]]


@pytest.mark.parametrize(("names", "twice"), [(("a.jpg", "a.cls", "a.jpg"), "'a.jpg' and 'a.jpg'"),
                                              (("a.jpg", "a.JPG"), "'a.jpg' and 'a.JPG'")])
def test_a_member_twice_in_a_sample_is_refused_naming_both(names, twice, tmp_path):
    """WebDataset raises "duplicate file name in tar file"; the index kept the second silently."""
    path = tmp_path / "000000.tar"
    with webdataset.TarWriter(str(path)) as writer:  # one sample written in parts: its members stay together
        for name in names:
            key, extension = name.split(".")
            writer.write({"__key__": key, extension: b"1" if extension == "cls" else jpeg(9)})
    ext = "cls" if twice.startswith("'a.cls") else "jpg"
    with pytest.raises(ValueError, match=rf"^{path}: sample 'a' has two '{ext}' members, {twice} \(extensions "
                                         r"compared lower-cased\): WebDataset refuses such a shard too"):
        tar_shards(str(path), index_dir=str(tmp_path / "indexes"))


def tar_of_four(path) -> bytes:
    with webdataset.TarWriter(str(path)) as writer:
        for index in range(4):
            writer.write({"__key__": f"s{index}", "jpg": bytes(3000), "cls": str(index).encode()})
    return path.read_bytes()


@pytest.mark.parametrize(("keep", "where"), [
    (5000, r"its bytes end at byte 5000, inside member 's0.jpg' \(its data is bytes 3584 to 6584\)"),
    (6656, r"its bytes end at byte 6656, after member 's0.jpg', where a header or the end-of-archive blocks belong"),
    (8000, r"its bytes end at byte 8000, after member 's0.jpg', where a header or the end-of-archive blocks belong"),
    (100, r"its bytes end at byte 100, inside its first header"),
])
def test_a_tar_cut_short_while_learning_is_a_data_error_naming_the_shard_and_byte(keep, where, tmp_path):
    """A data error, once (not retried, not a ``StorageError``), and never a shard quietly
    shorter: a cut at a member's end used to give the samples before it and nothing else."""
    path = tmp_path / "000000.tar"
    path.write_bytes(tar_of_four(path)[:keep])
    with pytest.raises(ValueError, match=rf"^{path}: the tar is cut short: {where}; a partial upload or copy\? "
                                         r"write the shard again$") as raised:
        tar_shards(str(path), index_dir=str(tmp_path / "indexes"))
    assert not isinstance(raised.value, StorageError)


def test_a_tar_with_its_end_of_archive_blocks_cut_is_whole(tmp_path):
    path = tmp_path / "000000.tar"
    whole = tar_of_four(path)
    with tarfile.open(path) as tar:
        last = tar.getmembers()[-1]
    end = last.offset_data + -(-last.size // 512) * 512
    assert whole[end:] == bytes(len(whole) - end) and len(whole) - end > 1024
    path.write_bytes(whole[:end + 512])  # the last member's padded data and one zero block of the two
    assert tar_shards(str(path), index_dir=str(tmp_path / "indexes")).labels.tolist() == [0, 1, 2, 3]


def copied_mds(tmp_path, edit) -> str:
    folder = tmp_path / "mds"
    shutil.copytree(FIXTURES / "mds", folder)
    index = json.loads((folder / "index.json").read_text())
    edit(index)
    (folder / "index.json").write_text(json.dumps(index))
    return str(folder)


def test_an_mds_index_naming_a_shard_twice_is_refused_naming_the_index_and_shard(tmp_path):
    """Streaming reads such an index's shard twice (one reader per entry): its samples would come
    twice an epoch."""
    folder = copied_mds(tmp_path, lambda index: index["shards"].append(dict(index["shards"][1])))
    with pytest.raises(ValueError, match=rf"^{folder}/index.json: shards 1 and 3 both name the file "
                                         r"'shard.00001.mds': its samples would come twice an epoch"):
        mds(folder)
    again = copied_mds(tmp_path / "b",
                       lambda index: index["shards"][2]["raw_data"].update(basename="./shard.00000.mds"))
    with pytest.raises(ValueError, match=r"shards 0 and 2 both name the file './shard.00000.mds'"):
        mds(again)


@pytest.mark.parametrize(("encoding", "cause"), [
    ("ndarray:int16:2,x", r"the shape '2,x' is not sizes separated by commas \(as in ndarray:int16:3,4\)"),
    ("ndarray:int16:", r"the shape '' is not sizes separated by commas"),
    ("ndarray:bfloat16", r"'bfloat16' is not one of MDS's ndarray dtypes \(uint8, int8, .*float64\)"),
])
def test_an_mds_column_type_that_does_not_parse_names_the_column_and_cause(encoding, cause, tmp_path):
    def edit(index):
        for shard in index["shards"]:
            shard["column_encodings"][0] = encoding  # column 'arr'
    folder = copied_mds(tmp_path, edit)
    with pytest.raises(ValueError, match=rf"^{folder}/index.json: shard 0: column 'arr' has encoding "
                                         rf"'{encoding}': {cause}"):
        mds(folder)


def bfloat16_at(index: int) -> dict:
    """A float32 tensor, but bfloat16 for sample 3, or from the first sample on for 100 + n."""
    dtype = torch.bfloat16 if index == 3 or index >= 100 else torch.float32
    return {"id": index, "meta": {"x": torch.full((2,), float(index), dtype=dtype)}}


@pytest.mark.parametrize("processes", MODES)
@pytest.mark.parametrize("first", [0, 100])
def test_a_bfloat16_tensor_from_decode_names_the_sample_field_and_cause(first, processes):
    """NumPy, which holds the batch buffers, has no bfloat16: the first sample (which teaches the
    layout) or a later one, named with its field, not torch's bare "unsupported ScalarType"."""
    items = list(range(first, first + 8))
    with AsyncLoader(items, batch_size=4, shuffle=False, read=False, decode=bfloat16_at,
                     processes=processes) as loader:
        with pytest.raises(SampleError, match=rf"^sample {first or 3} failed at decode: UnsupportedTensor: field "
                                              r"'meta.x' is a torch.bfloat16 tensor, a dtype NumPy \(the batch "
                                              r"buffers\) lacks: return another dtype \(.float\(\), or "
                                              r".view\(torch.int16\) to keep its bits\)$"):
            list(loader)


def requires_grad_at(index: int) -> tuple:
    return torch.full((2,), float(index), requires_grad=index == 2), index


def test_a_tensor_that_requires_grad_names_the_field_and_the_fix():
    with AsyncLoader(list(range(4)), batch_size=4, shuffle=False, read=False, decode=requires_grad_at,
                     processes=0) as loader:
        with pytest.raises(SampleError, match=r"^sample 2 failed at decode: UnsupportedTensor: field '\[0\]' is a "
                                              r"tensor that requires grad: return it without its graph "
                                              r"\(.detach\(\)\)$"):
            list(loader)
