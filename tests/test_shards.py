"""Tar shards: written from a folder, read with ranged requests, shuffled, resumed, sharded across
ranks, cached on disk; from local disk and from a real S3-compatible server."""

from __future__ import annotations

import json
import math
import re
import os
import sys
import tarfile
import threading

import numpy as np
import pytest
import torch

from asyncload import AsyncLoader, ImageDecoder, SampleError, image_folder, index_shards, tar_shards, write_shards
from asyncload.sources.shard_plan import plan_chunks
from asyncload.order.shard_order import ShardSampler, buffer_shuffle
from asyncload.stats.verdict import diagnose
from tests.support.s3server import LatencyProxy, storage_options
from tests.conftest import CLASSES, PER_CLASS, delivered, flat, identify, make_bucket, setup_s3fs

ALL = {(label, index) for label in range(len(CLASSES)) for index in range(PER_CLASS)}
DECODE = ImageDecoder(32)


@pytest.fixture(scope="session")
def s3_shards(s3_options, shard_dir) -> str:
    """The shard set uploaded to ``s3://asyncload-test/shards``."""
    with setup_s3fs(s3_options) as fs:
        make_bucket(fs)
        for path in sorted(shard_dir.iterdir()):
            fs.pipe_file(f"asyncload-test/shards/{path.name}", path.read_bytes())
    return "s3://asyncload-test/shards"


def test_every_sample_once_per_epoch_with_its_label(shard_dir):
    source = tar_shards(str(shard_dir), shuffle_buffer=6)
    assert len(source) == 24 and len(source.urls) == 5 and source.classes == list(CLASSES)
    with AsyncLoader(source, batch_size=5, decode=DECODE) as loader:
        for epoch in range(2):
            loader.set_epoch(epoch)
            batches = delivered(loader)
            assert [len(b) for b in batches] == [5, 5, 5, 5, 4]
            assert sorted(flat(batches)) == sorted(ALL)
            assert loader.stats.as_dict()["read/items"] == 5 * (epoch + 1)  # one ranged read per shard


def test_pixels_equal_the_folder_loader(shard_dir, jpeg_folder):
    """Same JPEG bytes, same decode: a sample from a shard is the image from the folder."""
    source = tar_shards(str(shard_dir))
    with AsyncLoader(source, batch_size=24, shuffle=False, decode=DECODE) as loader:
        (shard_images, shard_labels), = list(loader)
    with AsyncLoader(image_folder(str(jpeg_folder)), batch_size=24, shuffle=False, decode=DECODE) as loader:
        (images, labels), = list(loader)
    assert torch.equal(shard_images, images) and torch.equal(shard_labels, labels)


def test_order_repeats_with_the_seed_and_changes_with_the_epoch(shard_dir):
    def order(seed, epoch):
        with AsyncLoader(tar_shards(str(shard_dir), shuffle_buffer=4), batch_size=8, seed=seed, decode=DECODE) as loader:
            loader.set_epoch(epoch)
            return flat(delivered(loader))

    first = order(0, 0)
    assert first == order(0, 0)
    assert first != order(0, 1) and first != order(1, 0)
    storage = sorted(ALL)  # image_folder's order: class by class
    assert first != storage


def test_the_shuffle_buffer_bounds_how_far_ahead_a_sample_comes_from():
    stream = np.arange(1000)
    out = buffer_shuffle(stream, 50, np.random.default_rng(0))
    assert sorted(out.tolist()) == stream.tolist()
    assert all(sample <= position + 50 for position, sample in enumerate(out.tolist()))
    assert np.abs(out - stream).mean() > 10  # and it does mix


def test_ranks_read_disjoint_contiguous_parts_of_equal_length(shard_dir):
    source = tar_shards(str(shard_dir), shuffle_buffer=3)
    parts = []
    for rank in range(2):
        with AsyncLoader(source, batch_size=4, decode=DECODE, rank=rank, world_size=2) as loader:
            parts.append(flat(delivered(loader)))
            reads = loader.stats.as_dict()["read/items"]
        assert reads <= 3  # 12 samples of 5-sample shards touch at most 3 shards, one read each
    assert len(parts[0]) == len(parts[1]) == 12
    assert set(parts[0]).isdisjoint(parts[1]) and set(parts[0]) | set(parts[1]) == ALL


def test_padding_and_drop_last_as_distributed_sampler(shard_dir):
    source = tar_shards(str(shard_dir))
    padded = [ShardSampler(source, 4, shuffle=True, seed=0, drop_last=False, rank=r, world_size=5).order(0) for r in range(5)]
    assert [len(p) for p in padded] == [5] * 5
    everything = np.concatenate(padded)
    assert set(everything.tolist()) == set(range(24)) and len(everything) == 25  # one sample twice
    dropped = [ShardSampler(source, 4, shuffle=True, seed=0, drop_last=True, rank=r, world_size=5).order(0) for r in range(5)]
    assert [len(d) for d in dropped] == [4] * 5 and len(set(np.concatenate(dropped).tolist())) == 20


def test_a_padded_epoch_delivers_a_sample_twice_on_one_rank(shard_dir):
    """With more ranks than samples a rank's part repeats a sample: it must come out twice."""
    source = tar_shards(str(shard_dir))
    sampler = ShardSampler(source, 4, shuffle=False, seed=0, drop_last=False, rank=0, world_size=25)
    assert sampler.order(0).tolist() == [0]
    with AsyncLoader(source, batch_size=2, shuffle=False, decode=DECODE, rank=24, world_size=25) as loader:
        assert flat(delivered(loader)) == [sorted(ALL)[0]]


def test_resume_delivers_the_rest_without_reading_the_delivered_samples(shard_dir):
    source = tar_shards(str(shard_dir), shuffle_buffer=6)
    with AsyncLoader(source, batch_size=4, decode=DECODE, seed=5) as loader:
        loader.set_epoch(1)
        whole = delivered(loader)
    with AsyncLoader(source, batch_size=4, decode=DECODE, seed=5) as loader:
        loader.set_epoch(1)
        iterator = iter(loader)
        next(iterator), next(iterator), next(iterator)
        state = json.loads(json.dumps(loader.state_dict()))  # as saved in a checkpoint
        iterator.close()
    with AsyncLoader(source, batch_size=4, decode=DECODE, seed=5) as loader:
        loader.load_state_dict(state)
        rest = delivered(loader)
        read_bytes = loader.stats.as_dict()["read/bytes"]
    assert rest == whole[3:]
    order = ShardSampler(source, 4, shuffle=True, seed=5, drop_last=False, rank=0, world_size=1).order(1)
    remaining = plan_chunks(source, order[12:], source.chunk_bytes)
    assert read_bytes == sum(chunk.end - chunk.start for chunk in remaining)
    assert not set(index for chunk in remaining for index in chunk.indices) & set(order[:12].tolist())


@pytest.mark.parametrize("key, options", [("shuffle_buffer", dict(shuffle_buffer=3)), ("members", dict(members="all"))])
def test_resume_refuses_other_shard_options(shard_dir, key, options):
    """A shard order also depends on the shuffle buffer; the members read decide what a sample
    is: a state saved with other ones must not resume."""
    with AsyncLoader(tar_shards(str(shard_dir), shuffle_buffer=6), batch_size=4, decode=DECODE) as loader:
        iterator = iter(loader)
        next(iterator)
        state = loader.state_dict()
        iterator.close()
    other = tar_shards(str(shard_dir), **{"shuffle_buffer": 6, **options})
    with AsyncLoader(other, batch_size=4, decode=lambda sample: np.zeros(1)) as changed:
        with pytest.raises(ValueError, match=f"{key}=.*another order"):
            changed.load_state_dict(state)


def test_an_epoch_from_s3_equals_the_local_one_in_one_request_per_shard(shard_dir, s3_shards, s3_options):
    local = tar_shards(str(shard_dir), shuffle_buffer=5)
    remote = tar_shards(s3_shards, storage_options=s3_options, shuffle_buffer=5)
    with AsyncLoader(local, batch_size=6, decode=DECODE) as loader:
        expected = [(images.clone(), labels.clone()) for images, labels in loader]
    with AsyncLoader(remote, batch_size=6, decode=DECODE, storage_options=s3_options) as loader:
        got = [(images.clone(), labels.clone()) for images, labels in loader]
        assert loader.stats.as_dict()["read/items"] == 5
    assert len(got) == len(expected) == 4
    assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(got, expected))


def test_shards_are_written_and_indexed_in_s3_through_obstore(shard_dir, s3_jpeg_bucket, s3_shards, s3_options,
                                                              monkeypatch):
    """write_shards from a bucket into a bucket, and index_shards of shards in a bucket, with the
    loader's client (obstore): s3fs, an optional extra, is not needed (its import fails here)."""
    pytest.importorskip("obstore")
    monkeypatch.setitem(sys.modules, "s3fs", None)
    written = write_shards(image_folder(s3_jpeg_bucket, storage_options=s3_options), "s3://asyncload-test/written",
                           samples_per_shard=5, storage_options=s3_options)
    assert written == "s3://asyncload-test/written/index.json"
    local = json.loads((shard_dir / "index.json").read_text())
    remote = tar_shards(written, storage_options=s3_options, shuffle_buffer=5)
    assert remote.urls == [f"s3://asyncload-test/written/{s['url']}" for s in local["shards"]]
    assert remote.shard_bytes.tolist() == [s["bytes"] for s in local["shards"]]
    urls = [f"{s3_shards}/{s['url']}" for s in local["shards"]]
    indexed = index_shards(urls, "s3://asyncload-test/indexed/index.json", storage_options=s3_options, classes=CLASSES)
    expected = epoch_of(tar_shards(str(shard_dir), shuffle_buffer=5))
    with pytest.raises(ValueError, match="outside the index's folder"):
        tar_shards(indexed, storage_options=s3_options)  # its shards are in another folder
    for index_url in (written, indexed):
        source = tar_shards(index_url, storage_options=s3_options, shuffle_buffer=5, allow_external_shards=True)
        got = epoch_of(source, storage_options=s3_options)
        assert len(got) == 4 and all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(got, expected))


def epoch_of(source, **kwargs) -> list[tuple[torch.Tensor, torch.Tensor]]:
    with AsyncLoader(source, batch_size=6, decode=DECODE, **kwargs) as loader:
        return [(images.clone(), labels.clone()) for images, labels in loader]


def test_small_chunks_split_a_shard_into_several_ranged_reads(shard_dir):
    source = tar_shards(str(shard_dir), chunk_bytes=1500)  # each sample is ~1 KB of JPEG
    with AsyncLoader(source, batch_size=8, decode=DECODE) as loader:
        assert sorted(flat(delivered(loader))) == sorted(ALL)
        assert loader.stats.as_dict()["read/items"] > 5


@pytest.fixture
def slow_shards(s3_server, s3_shards):
    """The S3 shard set behind 0.2 s of first-byte latency, one ranged read per sample (long
    enough for the tuner to act within the epoch, with SeaweedFS as quick as it is)."""
    with LatencyProxy(s3_server.port, (0.2, 0.2)) as proxy:
        options = storage_options(proxy.endpoint_url)
        yield tar_shards(s3_shards, storage_options=options, chunk_bytes=1), options


@pytest.mark.parametrize("io_concurrency, reads", [(None, 4), (2, 2)])
def test_io_concurrency_caps_the_ranged_reads_and_slow_ones_are_named_storage(slow_shards, io_concurrency, reads):
    source, options = slow_shards
    with AsyncLoader(source, batch_size=6, decode=DECODE, storage_options=options, io_concurrency=io_concurrency) as loader:
        assert sorted(flat(delivered(loader))) == sorted(ALL)
    figures = loader.stats.as_dict()
    assert figures["read/items"] == len(ALL)
    assert figures["io_concurrency"] == reads and figures["reads_in_flight/peak"] == reads
    name, evidence = diagnose(figures)
    assert name == "storage", evidence


def test_auto_reads_more_chunks_at_once_from_slow_storage(slow_shards):
    source, options = slow_shards
    # In storage order: a shuffled epoch's first batch waits for samples from all over it, so the
    # tuner's first look would come with most of the 24 reads done (SeaweedFS serves them fast).
    # The tuner looks at each batch (the loader's own stats, at the times the test says), not on
    # the clock: however slow the machine, it has its looks while the epoch runs.
    loader = AsyncLoader(source, batch_size=2, decode=DECODE, storage_options=options, io_concurrency="auto",
                         shuffle=False)
    loader.tuner.interval = math.inf  # no look of its own
    got = []
    with loader:  # one epoch: the raise must reach the reads of the epoch that is running
        for now, (images, labels) in enumerate(loader):
            loader.tuner.look(loader.stats.as_dict(), float(now))
            seen = [identify(image.numpy()) for image in images]
            assert [label for label, _ in seen] == labels.tolist()
            got.extend(seen)
    assert sorted(got) == sorted(ALL)
    assert loader.stats.limits["io_concurrency"] > 4
    assert loader.stats.as_dict()["reads_in_flight/peak"] > 4
    assert [name for _, name, *_ in loader.tuner.changes][:1] == ["io_concurrency"]


def test_the_disk_cache_downloads_each_shard_once(shard_dir, s3_shards, s3_options, tmp_path):
    cache = tmp_path / "cache"

    def epoch(results, index):
        source = tar_shards(s3_shards, storage_options=s3_options, cache_dir=str(cache))
        with AsyncLoader(source, batch_size=8, decode=DECODE, storage_options=s3_options) as loader:
            results[index] = (sorted(flat(delivered(loader))), loader.stats.as_dict()["read/items"])

    results: list = [None, None]  # two loaders at once share the folder, as two ranks would
    threads = [threading.Thread(target=epoch, args=(results, i)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results[0][0] == results[1][0] == sorted(ALL)
    assert results[0][1] + results[1][1] == 5  # each shard downloaded by one of them
    cached = sorted(p for p in cache.iterdir() if p.suffix == ".tar")
    assert len(cached) == 5 and not [p for p in cache.iterdir() if p.name.endswith(".part")]
    again: list = [None]
    epoch(again, 0)
    assert again[0] == (sorted(ALL), 0)  # all from disk


@pytest.mark.parametrize("processes", [0, 2])
def test_remote_shards_through_the_disk_cache_give_the_local_epoch_in_one_read_per_shard(
        shard_dir, s3_server, s3_shards, tmp_path, processes):
    """With processes=2 a fill's stream closed the cache the others were downloading through, and
    the epoch hung (slow storage makes the downloads overlap). The run's reads are planned once,
    each chunk read by one process: one ranged read per shard whatever the number of processes,
    and the same batches as from local disk."""
    local = tar_shards(str(shard_dir), shuffle_buffer=5)
    with AsyncLoader(local, batch_size=2, decode=DECODE) as loader:
        expected = delivered(loader)
    with LatencyProxy(s3_server.port, (0.1, 0.3)) as proxy:
        options = storage_options(proxy.endpoint_url)
        remote = tar_shards(s3_shards, storage_options=options, shuffle_buffer=5, cache_dir=str(tmp_path / "cache"),
                            chunk_bytes=1 << 30)
        with AsyncLoader(remote, batch_size=2, decode=DECODE, storage_options=options, processes=processes,
                         prefetch=4) as loader:
            assert delivered(loader) == expected
            assert loader.stats.as_dict()["read/items"] == 5, "each shard downloaded once, in one read"
            loader.set_epoch(1)
            assert sorted(flat(delivered(loader))) == sorted(ALL)
            assert loader.stats.as_dict()["read/items"] == 5, "epoch 1: from disk"


@pytest.mark.parametrize("processes", [0, 2])
def test_a_run_makes_the_same_ranged_reads_whatever_the_number_of_processes(shard_dir, processes):
    """Each batch in its own stream made a read per batch and shard (88,285 reads for 100k
    samples where in-process made 600); now a run reads each chunk once."""
    source = tar_shards(str(shard_dir), shuffle_buffer=8, chunk_bytes=6000)
    wanted = ShardSampler(source, 4, shuffle=True, seed=0, drop_last=False, rank=0, world_size=1).order(0)
    chunks = len(plan_chunks(source, wanted, source.chunk_bytes))
    assert chunks > 5, "several chunks per shard"
    with AsyncLoader(source, batch_size=4, decode=DECODE, processes=processes) as loader:
        assert sorted(flat(delivered(loader))) == sorted(ALL)
        assert loader.stats.as_dict()["read/items"] == chunks


def test_a_cache_smaller_than_a_shard_still_serves_every_sample(s3_shards, s3_options, tmp_path):
    """A shard larger than the whole cache is read from storage, with a warning (a shard larger
    than cache_bytes failed every sample on a disk that could not hold it)."""
    source = tar_shards(s3_shards, storage_options=s3_options, cache_dir=str(tmp_path), cache_bytes=1)
    with AsyncLoader(source, batch_size=8, decode=DECODE, storage_options=s3_options) as loader:
        with pytest.warns(RuntimeWarning, match="larger than cache_bytes"):
            assert sorted(flat(delivered(loader))) == sorted(ALL)
    assert not list(tmp_path.glob("*.tar"))  # larger than the cache: read from storage, never kept


def test_the_disk_cache_stays_within_its_size(s3_shards, s3_options, tmp_path):
    source = tar_shards(s3_shards, storage_options=s3_options, cache_dir=str(tmp_path), cache_bytes=25_000)
    shard_size = int(source.shard_bytes.max())
    with AsyncLoader(source, batch_size=8, decode=DECODE, storage_options=s3_options) as loader:
        assert sorted(flat(delivered(loader))) == sorted(ALL)
    kept = sum(p.stat().st_size for p in tmp_path.iterdir() if p.suffix == ".tar")
    assert shard_size <= kept <= 25_000 + shard_size


def test_index_shards_indexes_shards_written_by_tar(shard_dir, tmp_path):
    """Shards written by plain tarfile (as WebDataset's writer does), indexed after the fact."""
    for number in range(2):
        with tarfile.open(tmp_path / f"part-{number}.tar", "w") as tar:
            for path in sorted(shard_dir.glob("*.tar"))[number * 2 : number * 2 + 2]:
                with tarfile.open(path) as source:
                    for member in source.getmembers():
                        member.name = f"train/{member.name}"
                        tar.addfile(member, source.extractfile(member))
    urls = sorted(str(p) for p in tmp_path.glob("part-*.tar"))
    source = tar_shards(index_shards(urls, classes=CLASSES), shuffle_buffer=2)
    assert len(source) == 20 and source[0][0].key == "train/00000000"
    with AsyncLoader(source, batch_size=7, decode=DECODE) as loader:
        assert sorted(flat(delivered(loader))) == sorted(ALL)[:20]


def test_all_members_reach_a_user_decode(shard_dir):
    def decode(members):
        return np.frombuffer(members["cls"], dtype=np.uint8)[:1].astype(np.int64) - ord("0")

    source = tar_shards(str(shard_dir), members="all")
    with AsyncLoader(source, batch_size=24, shuffle=False, decode=decode) as loader:
        (cls, labels), = list(loader)
    assert cls[:, 0].tolist() == labels.tolist()
    with pytest.raises(ValueError, match="pass a decode="):
        AsyncLoader(source, batch_size=4)


def corrupt_copy(shard_dir, tmp_path, sample: int, truncate: bool = False):
    """The shard set with sample ``sample``'s JPEG bytes scrambled (or its shard cut short)."""
    index = json.loads((shard_dir / "index.json").read_text())
    for path in shard_dir.glob("*.tar"):
        (tmp_path / path.name).write_bytes(path.read_bytes())
    shard = index["shards"][sample // 5]
    ext, offset, size = shard["members"][sample % 5][0]
    path = tmp_path / shard["url"]
    data = bytearray(path.read_bytes())
    if truncate:
        data = data[: offset + size // 2]
    else:
        data[offset + 2 : offset + size] = bytes(size - 2)
    path.write_bytes(bytes(data))
    (tmp_path / "index.json").write_text(json.dumps(index))
    return f"{path}#{shard['keys'][sample % 5]}"


def test_a_corrupt_sample_names_its_shard_and_key(shard_dir, tmp_path):
    name = corrupt_copy(shard_dir, tmp_path, sample=7)
    with AsyncLoader(tar_shards(str(tmp_path)), batch_size=4, shuffle=False, decode=DECODE) as loader:
        with pytest.raises(SampleError) as caught:
            list(loader)
    assert caught.value.stage == "decode" and repr(caught.value.item) == repr(name)
    assert name in str(caught.value)


def test_a_truncated_shard_fails_its_samples_with_a_clear_error(shard_dir, tmp_path):
    name = corrupt_copy(shard_dir, tmp_path, sample=12, truncate=True)
    with AsyncLoader(tar_shards(str(tmp_path)), batch_size=4, shuffle=False, decode=DECODE) as loader:
        with pytest.raises(SampleError, match=r"read: ShardTruncated: .*shard-000002.tar ends at byte") as caught:
            list(loader)
    assert repr(caught.value.item).startswith(repr(name.split("#")[0])[:-1])


def test_skip_drops_the_bad_sample_and_delivers_the_rest_once(shard_dir, tmp_path):
    corrupt_copy(shard_dir, tmp_path, sample=7)
    with AsyncLoader(tar_shards(str(tmp_path), shuffle_buffer=4), batch_size=5, decode=DECODE,
                     on_error="skip", max_failures=1) as loader:
        got = flat(delivered(loader))
        failures = loader.stats.failures
    assert len(got) == 23 and len(set(got)) == 23 and sorted(ALL)[7] not in got
    assert len(failures) == 1 and failures[0].stage == "decode" and failures[0].item.key == "00000007"


def test_a_missing_shard_names_it(shard_dir, tmp_path):
    index = json.loads((shard_dir / "index.json").read_text())
    (tmp_path / "index.json").write_text(json.dumps(index))  # the index without its shards
    with AsyncLoader(tar_shards(str(tmp_path)), batch_size=4, decode=DECODE) as loader:
        with pytest.raises(SampleError, match=r"shard-00000\d.tar#\d+.* failed at read: FileNotFoundError"):
            list(loader)


def test_read_is_the_loaders_own_for_shards(shard_dir):
    with pytest.raises(ValueError, match="leave read=None"):
        AsyncLoader(tar_shards(str(shard_dir)), batch_size=4, read=lambda key: key)


def run_with_deadline(work, seconds: float = 60.0):
    """``work()`` on a thread; fails instead of hanging the suite if it does not end in time."""
    result: dict = {}

    def target():
        try:
            result["value"] = work()
        except BaseException as error:  # handed to the test's thread
            result["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    return thread.is_alive(), result


def test_ranks_with_a_skipped_sample_finish_with_equal_batches(shard_dir, tmp_path):
    """DDP, tar shards, on_error="skip": the rank with a corrupt sample pads with its first
    samples again, whose bytes it has already used; it must finish with len(loader) batches
    (it used to wait forever on a read nothing would resolve)."""
    corrupt_copy(shard_dir, tmp_path, sample=7)  # on rank 0 (unshuffled: samples 0-11)
    counts, got = [], {}
    for rank in range(2):
        loader = AsyncLoader(tar_shards(str(tmp_path)), batch_size=4, shuffle=False, decode=DECODE,
                             on_error="skip", max_failures=1, rank=rank, world_size=2)
        try:
            hung, result = run_with_deadline(lambda: delivered(loader))
        finally:
            loader.close()
        assert not hung, f"rank {rank} never finished its epoch"
        if "error" in result:
            raise result["error"]
        counts.append((len(result["value"]), len(loader)))
        got[rank] = flat(result["value"])
    assert counts == [(3, 3), (3, 3)]
    assert sorted(got[0]) == sorted(sorted(ALL)[:7] + sorted(ALL)[8:12] + sorted(ALL)[:1])  # sample 0 twice
    assert sorted(got[1]) == sorted(ALL)[12:]


def test_a_resumed_rank_pads_without_spurious_failures(shard_dir, tmp_path):
    """After a resume the padding repeats samples delivered before the checkpoint, which the new
    run did not plan to read: they are read again, not failed."""
    corrupt_copy(shard_dir, tmp_path, sample=7)
    kwargs = dict(batch_size=4, shuffle=False, decode=DECODE, on_error="skip", max_failures=1, rank=0,
                  world_size=2, prefetch=1)
    with AsyncLoader(tar_shards(str(tmp_path)), **kwargs) as loader:
        iterator = iter(loader)
        head = [next(iterator) for _ in range(2)]
        state = loader.state_dict()
        iterator.close()
    with AsyncLoader(tar_shards(str(tmp_path)), **kwargs) as resumed:
        resumed.load_state_dict(state)
        hung, result = run_with_deadline(lambda: delivered(resumed))
        assert not hung, "the resumed rank never finished its epoch"
        if "error" in result:
            raise result["error"]
        assert resumed.stats.failures == []
    assert len(head) + len(result["value"]) == 3
    assert sorted(flat(result["value"])) == sorted(sorted(ALL)[9:12] + sorted(ALL)[:1])


@pytest.fixture()
def s3_shard_copy(s3_options, shard_dir, request):
    """The shard set uploaded to a prefix of this test's own (it may rewrite a shard there)."""
    import s3fs

    fs = s3fs.S3FileSystem(**s3_options, skip_instance_cache=True)
    make_bucket(fs)
    prefix = f"asyncload-test/copies/{request.node.name}"
    for path in sorted(shard_dir.iterdir()):
        fs.pipe_file(f"{prefix}/{path.name}", path.read_bytes())
    return fs, prefix


@pytest.mark.parametrize("processes", [0, 2])
def test_the_disk_cache_notices_a_rewritten_shard(s3_shard_copy, s3_options, shard_dir, tmp_path, processes):
    """A kept shard whose object was rewritten since (same size: the index still fits) must not
    be served: the new content is downloaded (with processes=2 it was served for ever)."""
    fs, prefix = s3_shard_copy
    cache = tmp_path / "cache"

    def epoch(**kwargs):
        source = tar_shards(f"s3://{prefix}", storage_options=s3_options, cache_dir=str(cache))
        with AsyncLoader(source, batch_size=8, decode=DECODE, storage_options=s3_options, processes=processes,
                         **kwargs) as loader:
            return sorted(flat(delivered(loader)))

    assert epoch() == sorted(ALL)
    rewritten = corrupt_copy(shard_dir, tmp_path, sample=7)  # sample 7's bytes zeroed, same size
    fs.pipe_file(f"{prefix}/shard-000001.tar", (tmp_path / "shard-000001.tar").read_bytes())
    with pytest.raises(SampleError) as caught:
        epoch()
    assert caught.value.stage == "decode" and caught.value.item.key == rewritten.split("#")[1]


def test_partial_downloads_of_a_killed_process_are_removed(s3_shard_copy, s3_options, tmp_path):
    """A ``.part`` whose shard no process is downloading (its lock is free) was left by a killed
    process: the next eviction deletes it, and the lock and meta files of shards no longer kept
    go too. One being written (lock held) stays."""
    import fcntl

    from asyncload.cache.files import shard_files

    fs, prefix = s3_shard_copy
    source = tar_shards(f"s3://{prefix}", storage_options=s3_options, cache_dir=str(tmp_path), cache_bytes=1 << 20)
    first = shard_files(tmp_path, source.urls[0])
    abandoned = tmp_path / f"{first.new_part().name}"
    abandoned.write_bytes(bytes(50_000))
    first.lock.touch()  # what a killed download leaves: its lock, free, and its part
    gone = shard_files(tmp_path, "s3://elsewhere/evicted.tar")  # a shard evicted long ago: its lock and meta
    gone.lock.touch()
    gone.meta.write_text("{}")
    other = shard_files(tmp_path, "s3://elsewhere/other.tar")  # another job's shard, being written
    writing = other.new_part()
    writing.write_bytes(bytes(10_000))
    held = os.open(other.lock, os.O_CREAT | os.O_RDWR)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)  # as the process downloading it holds it
        with AsyncLoader(source, batch_size=8, decode=DECODE, storage_options=s3_options) as loader:
            assert sorted(flat(delivered(loader))) == sorted(ALL)
        assert not abandoned.exists(), "a killed process's partial download stays for ever"
        assert not gone.lock.exists() and not gone.meta.exists(), "files of an evicted shard stay for ever"
        assert writing.exists() and other.lock.exists(), "a download under way was deleted"
    finally:
        os.close(held)


def test_a_shard_evicted_by_another_process_while_touched_is_downloaded_again(tmp_path):
    """Another process evicts the kept shard at any moment (here: a thread deleting it every
    2 ms): the cache must download it again, never fail a read on the race."""
    import asyncio

    from asyncload.cache.shards import ShardCache

    remote = tmp_path / "remote.tar"
    remote.write_bytes(bytes(range(256)) * 64)

    async def download(url, start, end):
        with open(remote, "rb") as file:
            return os.pread(file.fileno(), end - start, start)

    async def run_blocking(function, *args):
        return function(*args)  # the race needs no thread between exists and utime to widen it

    cache = ShardCache(tmp_path / "cache", 1 << 30, download, 1 << 20, run_blocking)
    path = cache.path("s3://bucket/remote.tar")
    stop = threading.Event()

    def evict():
        while not stop.wait(0.002):
            path.unlink(missing_ok=True)

    async def reads():
        for i in range(3000):
            start = (i * 37) % 16000
            assert await cache.read_range("s3://bucket/remote.tar", start, start + 100, 16384) == remote.read_bytes()[start:start + 100]

    evictor = threading.Thread(target=evict)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # the GIL changes hands often: the evictor can run between any two steps
    evictor.start()
    try:
        asyncio.run(reads())
    finally:
        stop.set()
        evictor.join()
        sys.setswitchinterval(switch)


# ----- hostile or wrong indexes -----

def index_with(shard_dir, change) -> dict:
    index = json.loads((shard_dir / "index.json").read_text())
    change(index["shards"])
    return index


@pytest.mark.parametrize("change, field, message", [
    (lambda s: s[1].update(url="/etc/passwd"), "url", "'/etc/passwd' points to another location"),
    (lambda s: s[1].update(url="file:///etc/passwd"), "url", "points to another protocol or store"),
    (lambda s: s[1].update(url="s3://other-bucket/x.tar"), "url", "points to another protocol or store"),
    (lambda s: s[1].update(url="../../x.tar"), "url", "climbs out of the index's folder"),
    (lambda s: s[1].update(url="a/../../x.tar"), "url", "climbs out of the index's folder"),
    (lambda s: s[1].update(bytes=-1), "bytes", "must be an integer in [0, 2**40], got -1"),
    (lambda s: s[1].update(bytes=2**62), "bytes", "must be an integer in [0, 2**40]"),
    (lambda s: s[1].update(bytes="12"), "bytes", "got '12'"),
    (lambda s: s[1]["members"][2][0].__setitem__(1, -5), "offset", "is before the end of the first tar header"),
    (lambda s: s[1]["members"][2][0].__setitem__(2, -5), "size", "is negative"),
    (lambda s: s[1]["members"][2][0].__setitem__(2, 2**62), "size", "runs past the shard's end"),
    (lambda s: (s[1]["members"][2][0].__setitem__(1, 2**62), s[1]["members"][2][0].__setitem__(2, 2**62)),
     "size", "runs past the shard's end"),
    (lambda s: s[1]["members"][2][0].__setitem__(1, s[1]["members"][1][0][1]), "offset", "overlaps another member"),
    (lambda s: s[1]["members"][2][0].__setitem__(1, 1.5), "offset", "must be an integer, got 1.5"),
    (lambda s: s[1]["members"].pop(), "members", "one entry per key"),
    (lambda s: s[1]["members"].__setitem__(2, [["jpg", "A" * 10_000]]), "members", "each must be [extension, offset, size]"),
])
def test_a_hostile_index_entry_is_refused_naming_the_field(shard_dir, change, field, message):
    index = index_with(shard_dir, change)
    from asyncload.sources.shards import ShardSource

    with pytest.raises(ValueError) as caught:
        ShardSource(index, str(shard_dir))
    text = str(caught.value)
    assert text.startswith(f"shard index of {shard_dir}: shard 1") and f"field '{field}'" in text and message in text, text
    assert len(text) < 400, "an index's values are cut short in the message"


def test_external_shards_are_read_where_the_user_allows_them(shard_dir, tmp_path):
    index = index_with(shard_dir, lambda shards: [s.update(url=str(shard_dir / s["url"])) for s in shards])
    (tmp_path / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"shard 0: field 'url' .* allow_external_shards=True"):
        tar_shards(str(tmp_path))
    with AsyncLoader(tar_shards(str(tmp_path), allow_external_shards=True), batch_size=24, decode=DECODE) as loader:
        assert sorted(flat(delivered(loader))) == sorted(ALL)


@pytest.mark.parametrize("chunk", [3000, 4096], ids=["short read", "read past the end"])
def test_an_index_bytes_larger_than_the_shard_is_read_from_storage_with_one_warning(shard_dir, s3_options, tmp_path,
                                                                                    chunk):
    """Through the disk cache a shorter shard was downloaded again for every chunk read from it
    (14x the requests): now the first download that meets its end says so, once, and the shard
    is read from storage for the rest of the run; each sample stands on its own bytes (here all
    of them are there: only the shard's total is wrong), whether it came from the download
    under way or from storage."""
    index = index_with(shard_dir, lambda shards: shards[0].update(bytes=shards[0]["bytes"] + 100_000))
    with setup_s3fs(s3_options) as fs:
        make_bucket(fs)
        for path in sorted(shard_dir.glob("*.tar")):
            fs.pipe_file(f"asyncload-test/bigger/{path.name}", path.read_bytes())
        fs.pipe_file("asyncload-test/bigger/index.json", json.dumps(index).encode())
    sizes = [s["bytes"] for s in json.loads((shard_dir / "index.json").read_text())["shards"]]
    source = tar_shards("s3://asyncload-test/bigger", s3_options, cache_dir=str(tmp_path), chunk_bytes=chunk)
    ends = f"at byte {sizes[0]}" if sizes[0] % chunk else f"at or before byte {sizes[0]}"  # the next range starts there
    with pytest.warns(RuntimeWarning, match=re.escape(
            f"s3://asyncload-test/bigger/shard-000000.tar ends {ends}, but its index says it holds "
            f"{sizes[0] + 100_000} bytes (field 'bytes'): read from storage, not cached")):
        with AsyncLoader(source, batch_size=4, shuffle=False, decode=DECODE, storage_options=s3_options) as loader:
            got = flat(delivered(loader))
    assert sorted(got) == sorted(ALL) and loader.stats.failures == []
    downloads = sum(-(-size // chunk) for size in sizes)  # every shard's chunks, once
    assert loader.stats.read.items <= downloads + 2 * (sizes[0] // chunk + 2), "no download per chunk read"


def test_index_shards_refuses_a_gnu_sparse_member_without_reading_it(tmp_path):
    """A 10 KB tar holding a sparse 2.3 GB ``.cls``: it was read whole and its repr put in the
    error (2.3 GB of memory, a 1 GB message)."""
    import resource
    import shutil
    import subprocess

    if shutil.which("tar") is None or "GNU" not in subprocess.run(["tar", "--version"], capture_output=True, text=True).stdout:
        pytest.skip("needs GNU tar to write a sparse member")
    (tmp_path / "00000000.jpg").write_bytes(b"x")
    with open(tmp_path / "00000000.cls", "wb") as file:
        file.truncate(2300 << 20)
    subprocess.run(["tar", "--sparse", "--format=gnu", "-cf", "shard.tar", "00000000.jpg", "00000000.cls"],
                   cwd=tmp_path, check=True)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ValueError) as caught:
        index_shards([str(tmp_path / "shard.tar")])
    assert str(caught.value) == (f"{tmp_path / 'shard.tar'}: member '00000000.cls' is a GNU sparse file: what the tar "
                                 "holds is not its content, so no byte range reads it; repack the shard without --sparse")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100_000, "not read"


def test_index_shards_reads_no_more_of_a_label_than_a_number_needs(tmp_path):
    import io

    with tarfile.open(tmp_path / "shard.tar", "w") as tar:
        for name, data in (("00000000.jpg", b"x"), ("00000000.cls", b"7" * 100_000)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(ValueError) as caught:
        index_shards([str(tmp_path / "shard.tar")])
    assert str(caught.value) == f"{tmp_path / 'shard.tar'}: '00000000.cls' holds b'{'7' * 65}', not an integer class"


def test_index_shards_records_shards_below_the_index_relative_to_it(shard_dir, tmp_path):
    (tmp_path / "part").mkdir()
    for path in sorted(shard_dir.glob("*.tar"))[:2]:
        (tmp_path / "part" / path.name).write_bytes(path.read_bytes())
    urls = sorted(str(p) for p in (tmp_path / "part").glob("*.tar"))
    index_url = index_shards(urls, str(tmp_path / "index.json"), classes=CLASSES)
    assert [s["url"] for s in json.loads((tmp_path / "index.json").read_text())["shards"]] == [
        "part/shard-000000.tar", "part/shard-000001.tar"]
    assert len(tar_shards(index_url)) == 10


def test_the_shard_sources_and_writer_import_no_decoder():
    """The member names live with ``decode/members.py``, which imports the image decoder only
    when it decodes one: describing or writing shards loads neither OpenCV, simplejpeg nor torch."""
    import subprocess

    code = ("import sys, asyncload.sources.shards, asyncload.sources.writer, asyncload.sources.chunked\n"
            "print(sorted(m for m in ('cv2', 'simplejpeg', 'torch') if m in sys.modules))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": root})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
