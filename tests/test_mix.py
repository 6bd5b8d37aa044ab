"""Mixing datasets: ``asyncload.mix`` draws each batch's rows from several sources by weight, with
a seeded sequence that is the sampler's order (so ranks and resume work on it as on any order);
each sample carries its source's number, labels stay each source's own, the stats count per
source. Integer sources with ``read=False`` for the sequences and proportions, real JPEG folders
for labels and source ids, ``processes=0`` and ``processes=2`` where a loader runs."""

from __future__ import annotations

import json
import shutil
from collections import Counter

import numpy as np
import pytest

import asyncload
from asyncload import AsyncLoader, ImageDecoder, image_folder, mix, parquet, tar_shards, write_parquet, write_shards
from asyncload.sources.mix import name_key
from tests.conftest import CLASSES, PER_CLASS, identify


def as_array(item: int) -> np.ndarray:
    """``read=False`` decode: the integer item itself is the sample (top level: it pickles)."""
    return np.array(item, dtype=np.int64)


def ints(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


def run_epoch(loader: AsyncLoader, batches: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(samples, source ids) of a pass, or of its first ``batches`` batches."""
    samples, ids = [], []
    for values, source_ids in loader:
        samples.append(values.numpy().copy())
        ids.append(source_ids.numpy().copy())
        if len(samples) == batches:
            break
    return np.concatenate(samples), np.concatenate(ids)


# ----- arguments -----

def test_bad_arguments_raise_clear_errors(tmp_path):
    a, b = ints(0, 10), ints(100, 10)
    with pytest.raises(ValueError, match=r"weights must name exactly the sources: sources \['a', 'b'\], weights \['a', 'c'\]"):
        mix({"a": a, "b": b}, {"a": 1, "c": 1})
    for weight in (0, -1.0, float("nan"), True, "1"):
        with pytest.raises(ValueError, match="the weight of 'b' must be a positive number"):
            mix({"a": a, "b": b}, {"a": 1, "b": weight})
    with pytest.raises(ValueError, match="source 'b' is empty"):
        mix({"a": a, "b": []}, {"a": 1, "b": 1})
    with pytest.raises(ValueError, match="stop must be 'first', 'all' or 'never', got 'last'"):
        mix({"a": a}, {"a": 1}, stop="last")
    with pytest.raises(ValueError, match="needs length="):
        mix({"a": a}, {"a": 1}, stop="never")
    with pytest.raises(ValueError, match="length= is for stop='never'"):
        mix({"a": a}, {"a": 1}, length=5)
    with pytest.raises(ValueError, match="all have \\(url, label\\) items or none"):
        mix({"a": [("x", 0)], "b": ["y"]}, {"a": 1, "b": 1})
    from asyncload.sources.shards import ShardSource

    shards = ShardSource.__new__(ShardSource)  # refused by its type, before anything is read
    with pytest.raises(TypeError, match=r"shard sources mix only with shard sources of the same kind .* "
                                         r"\{'a': 'items', 'b': 'ShardSource'\}"):
        mix({"a": a, "b": shards}, {"a": 1, "b": 1})
    from asyncload.sources.parquet import ParquetSource

    rows = ParquetSource.__new__(ParquetSource)
    with pytest.raises(TypeError, match=r"\{'a': 'ShardSource', 'b': 'ParquetSource'\}"):
        mix({"a": shards, "b": rows}, {"a": 1, "b": 1})
    with pytest.raises(TypeError, match="source 'b' is a MixedSource: a mix cannot be mixed again"):
        mix({"a": a, "b": mix({"c": a}, {"c": 1})}, {"a": 1, "b": 1})


# ----- the sequence -----

def test_the_sequence_is_a_function_of_seed_and_epoch():
    def build(seed: int) -> asyncload.MixedSource:
        return mix({"a": ints(0, 500), "b": ints(1000, 700)}, {"a": 2, "b": 1}, seed=seed, stop="all")

    first = build(3).sequence(epoch=4)
    assert np.array_equal(first, build(3).sequence(epoch=4))  # another object, the same draw
    assert not np.array_equal(first, build(3).sequence(epoch=5))
    assert not np.array_equal(first, build(4).sequence(epoch=4))
    assert not np.array_equal(first, build(3).sequence(epoch=4, seed=1))  # the loader's seed counts too


def test_within_a_source_items_come_in_its_own_order_from_seed_epoch_and_name():
    mixed = mix({"a": ints(0, 50), "b": ints(1000, 80)}, {"a": 1, "b": 1}, seed=7, stop="all")
    sequence = mixed.sequence(epoch=2)
    for number, name in enumerate(mixed.names):
        own = sequence[mixed.source_of(sequence) == number] - mixed.offsets[number]
        size = len(mixed.sources[number])
        assert np.array_equal(own, np.random.default_rng([7, 0, 2, name_key(name), 0]).permutation(size))
    in_order = mixed.sequence(epoch=2, shuffle=False)
    assert np.array_equal(in_order[mixed.source_of(in_order) == 1], np.arange(50, 130))


@pytest.mark.parametrize("stop", ["never", "all"])
def test_realised_proportions_are_the_weights_within_two_percent_over_10000_samples(stop):
    weights = {"a": 0.2, "b": 0.3, "c": 0.5}
    kwargs = {"length": 10_000} if stop == "never" else {}
    sources = {"a": ints(0, 3000), "b": ints(100_000, 20_000), "c": ints(200_000, 20_000)} if stop == "never" else \
        {name: ints(100_000 * i, 50_000) for i, name in enumerate(weights)}
    mixed = mix(sources, weights, seed=1, stop=stop, **kwargs)
    with AsyncLoader(mixed, batch_size=500, read=False, decode=as_array, num_threads=2) as loader:
        samples, ids = run_epoch(loader, batches=20)  # 10,000 samples
    assert len(samples) == 10_000
    counts = np.bincount(ids, minlength=3) / len(ids)
    assert np.all(np.abs(counts - np.array(list(weights.values()))) <= 0.02), counts
    assert np.array_equal(ids, samples // 100_000)  # each id names its item's source
    if stop == "never":  # "a" has 3000 items for its 2000 rows: each once
        assert len(set(samples[ids == 0].tolist())) == int((ids == 0).sum())


def test_stop_first_ends_when_one_source_has_given_all_its_items():
    mixed = mix({"small": ints(0, 100), "big": ints(1000, 1000)}, {"small": 1, "big": 1}, stop="first")
    assert mixed.epoch_length == 200
    with AsyncLoader(mixed, batch_size=32, read=False, decode=as_array, num_threads=2) as loader:
        assert len(loader) == 7
        samples, ids = run_epoch(loader)
    assert sorted(samples[ids == 0].tolist()) == ints(0, 100)  # every item of the smaller once
    assert len(set(samples[ids == 1].tolist())) == 100 and samples[ids == 1].min() >= 1000


def test_stop_all_gives_every_item_of_every_source_once():
    mixed = mix({"a": ints(0, 100), "b": ints(1000, 1000)}, {"a": 9, "b": 1}, stop="all")
    with AsyncLoader(mixed, batch_size=64, read=False, decode=as_array, num_threads=2) as loader:
        assert len(loader) == 18
        samples, ids = run_epoch(loader)
    assert sorted(samples.tolist()) == ints(0, 100) + ints(1000, 1000)
    assert np.array_equal(ids, (samples >= 1000).astype(np.int64))
    assert np.flatnonzero(ids == 0).max() < 400  # weighted 9:1, "a" runs out early; then "b" alone


def test_stop_never_cycles_each_source_for_the_given_length():
    mixed = mix({"a": ints(0, 10), "b": ints(1000, 1000)}, {"a": 1, "b": 3}, stop="never", length=2000)
    with AsyncLoader(mixed, batch_size=100, read=False, decode=as_array, num_threads=2) as loader:
        assert len(loader) == 20
        samples, ids = run_epoch(loader)
    assert Counter(samples[ids == 0].tolist()) == {i: 50 for i in range(10)}  # 500 rows: 50 cycles of 10
    from_b = samples[ids == 1]  # 1500 rows: a whole cycle of its 1000 items, then half a new shuffle
    assert sorted(from_b[:1000].tolist()) == ints(1000, 1000)
    assert len(set(from_b[1000:].tolist())) == 500 and not np.array_equal(from_b[1000:], from_b[:500])


# ----- labels and source ids, on real images -----

@pytest.fixture(scope="module")
def two_folders(jpeg_folder, tmp_path_factory):
    """``first``: cat, dog (labels 0, 1); ``second``: dog, fox (labels 0, 1): the same class
    has another label in each, as two datasets would."""
    root = tmp_path_factory.mktemp("two")
    for name, classes in (("first", ("cat", "dog")), ("second", ("dog", "fox"))):
        for cls in classes:
            shutil.copytree(jpeg_folder / cls, root / name / cls)
    return root


@pytest.mark.parametrize("processes", [0, 2])
def test_labels_stay_each_sources_own_and_each_sample_names_its_source(two_folders, processes):
    sources = {"first": image_folder(str(two_folders / "first")), "second": image_folder(str(two_folders / "second"))}
    mixed = mix(sources, {"first": 1, "second": 1}, seed=5, stop="all")
    with AsyncLoader(mixed, batch_size=5, decode=ImageDecoder(16), num_threads=2, processes=processes) as loader:
        batches = [(i.numpy().copy(), l.numpy().copy(), s.numpy().copy()) for i, l, s in loader]
        order = loader.sampler.order(0)
    images, labels, ids = (np.concatenate(part) for part in zip(*batches))
    assert ids.dtype == np.int64 and labels.dtype == np.int64
    assert np.array_equal(ids, mixed.source_of(order))
    assert [mixed[i][1] for i in order] == labels.tolist()
    seen = []
    for image, label, source_id in zip(images, labels, ids):
        true_class, index = identify(image)
        classes = sources[list(sources)[source_id]].classes
        assert classes[label] == CLASSES[true_class]  # the label is its own folder's
        seen.append((int(source_id), CLASSES[true_class], index))
    assert len(set(seen)) == 32  # every image of both folders once


# ----- resume, ranks, stats -----

@pytest.mark.parametrize("processes", [0, 2])
def test_state_dict_mid_epoch_resumes_the_exact_rest(processes):
    def build() -> asyncload.MixedSource:
        return mix({"a": ints(0, 300), "b": ints(1000, 200)}, {"a": 1, "b": 2}, seed=9, stop="never", length=400)

    kwargs = dict(batch_size=16, read=False, decode=as_array, num_threads=2, processes=processes)
    with AsyncLoader(build(), **kwargs) as whole:
        whole.set_epoch(3)
        all_samples, all_ids = run_epoch(whole)
    with AsyncLoader(build(), **kwargs) as first:
        first.set_epoch(3)
        head, _ = run_epoch(first, batches=7)
        state = first.state_dict()
    with AsyncLoader(build(), **kwargs) as resumed:
        resumed.load_state_dict(state)
        rest, rest_ids = run_epoch(resumed)
    assert np.array_equal(np.concatenate([head, rest]), all_samples)
    assert np.array_equal(rest_ids, all_ids[7 * 16:])
    other = mix({"a": ints(0, 300), "b": ints(1000, 200)}, {"a": 1, "b": 1}, seed=9, stop="never", length=400)
    with AsyncLoader(other, batch_size=16, read=False, decode=as_array, num_threads=2) as changed:
        with pytest.raises(ValueError, match="mix"):
            changed.load_state_dict(state)


@pytest.mark.parametrize("stop", ["first", "all"])
def test_ranks_take_disjoint_equal_shares_of_the_mixed_sequence(stop):
    mixed = mix({"a": ints(0, 301), "b": ints(1000, 500)}, {"a": 1, "b": 1}, seed=2, stop=stop)
    per_rank = []
    for rank in range(3):
        with AsyncLoader(mixed, batch_size=25, read=False, decode=as_array, num_threads=2, rank=rank, world_size=3,
                         drop_last=True) as loader:
            per_rank.append(run_epoch(loader)[0])
    assert len({len(samples) for samples in per_rank}) == 1
    together = np.concatenate(per_rank)
    assert len(set(together.tolist())) == len(together)  # each item once: disjoint ranks
    sequence = [mixed[i] for i in mixed.sequence(0)]
    dealt = np.array(sequence[: len(sequence) // 3 * 3]).reshape(-1, 3)  # DistributedSampler's deal
    for rank, samples in enumerate(per_rank):
        assert np.array_equal(samples, dealt[: len(samples), rank])


@pytest.mark.parametrize("processes", [0, 2])
def test_stats_count_the_samples_handed_out_per_source(processes):
    mixed = mix({"a": ints(0, 100), "b": ints(1000, 60)}, {"a": 1, "b": 1}, stop="all")
    with AsyncLoader(mixed, batch_size=16, read=False, decode=as_array, num_threads=2, processes=processes) as loader:
        assert loader.stats.sources == {}
        run_epoch(loader, batches=4)
        _, ids = run_epoch(loader)  # a second, whole pass: the counts add up over passes
        counted = loader.stats.sources
        figures = loader.stats.as_dict()
    assert sum(counted.values()) == 64 + 160
    assert counted["b"] - 60 == 64 - (counted["a"] - 100)
    assert figures["mix/a/samples"] == counted["a"] and figures["mix/b/samples"] == counted["b"]
    assert np.bincount(ids).tolist() == [100, 60]


# ----- shard sources: tar shards, Parquet files -----

HALF = len(CLASSES) * PER_CLASS // 2  # the test JPEGs split in two halves of 12
SHARD = 5  # samples per shard (row group): each half is 3 shards of 5, 5, 2


@pytest.fixture(scope="module")
def two_shard_sets(jpeg_folder, tmp_path_factory):
    """The two halves of the test JPEGs, each as its own tar shard set of ``SHARD`` samples."""
    items = list(image_folder(str(jpeg_folder)))
    root = tmp_path_factory.mktemp("mixshards")
    for name, part in (("first", items[:HALF]), ("second", items[HALF:])):
        write_shards(part, str(root / name), samples_per_shard=SHARD)
    return root


@pytest.fixture(scope="module")
def two_parquet_files(jpeg_folder, tmp_path_factory):
    """The same halves as two Parquet files of ``SHARD``-row row groups."""
    items = list(image_folder(str(jpeg_folder)))
    root = tmp_path_factory.mktemp("mixparquet")
    return [write_parquet(part, str(root / f"{name}.parquet"), rows_per_group=SHARD)
            for name, part in (("first", items[:HALF]), ("second", items[HALF:]))]


def shard_mix(kind: str, where, **options) -> asyncload.MixedSource:
    if kind == "tar":
        sources = {name: tar_shards(str(where / name), **options) for name in ("first", "second")}
    else:
        sources = {name: parquet(path, **options) for name, path in zip(("first", "second"), where)}
    return mix(sources, {"first": 1, "second": 1}, seed=3, stop="all")


def delivered_with_ids(loader: AsyncLoader, batches: int | None = None) -> list[tuple[int, int, int]]:
    """(source id, class, index) of each image of a pass; checks each label against its image."""
    seen = []
    for count, (images, labels, ids) in enumerate(loader, 1):
        for image, label, source_id in zip(images.numpy(), labels.tolist(), ids.tolist()):
            true_class, index = identify(image)
            assert label == true_class
            seen.append((source_id, true_class, index))
        if count == batches:
            break
    return seen


def expected_images() -> list[tuple[int, int, int]]:
    """Every test image once, with the number of the half (source) that holds it."""
    ordered = [(label, index) for label in range(len(CLASSES)) for index in range(PER_CLASS)]  # image_folder's order
    return sorted((int(n >= HALF), label, index) for n, (label, index) in enumerate(ordered))


@pytest.mark.parametrize("kind", ["tar", "parquet"])
@pytest.mark.parametrize("processes", [0, 2])
def test_shard_sources_mix_every_image_once_in_about_one_read_per_shard(kind, processes, two_shard_sets,
                                                                        two_parquet_files):
    mixed = shard_mix(kind, two_shard_sets if kind == "tar" else two_parquet_files, shuffle_buffer=4)
    assert len(mixed) == 2 * HALF and len(mixed.urls) == 6  # one shard set of both halves' shards
    with AsyncLoader(mixed, batch_size=5, decode=ImageDecoder(16), num_threads=2, processes=processes) as loader:
        seen = delivered_with_ids(loader)
        order = loader.sampler.order(0)
        reads = loader.stats.as_dict()["read/items"]
        assert sorted(seen) == expected_images()
        assert [source_id for source_id, _, _ in seen] == mixed.source_of(order).tolist()
        assert reads == 6, "one ranged read per shard, not one per sample"
        assert sorted(delivered_with_ids(loader)) == expected_images()  # a second epoch, another order
        assert loader.stats.as_dict()["read/items"] == 12
        assert loader.stats.sources == {"first": 2 * HALF, "second": 2 * HALF}


@pytest.mark.parametrize("kind", ["tar", "parquet"])
def test_a_shard_mix_resumes_mid_epoch_with_the_exact_rest(kind, two_shard_sets, two_parquet_files):
    where = two_shard_sets if kind == "tar" else two_parquet_files
    kwargs = dict(batch_size=4, decode=ImageDecoder(16), num_threads=2, seed=1)
    with AsyncLoader(shard_mix(kind, where), **kwargs) as loader:
        loader.set_epoch(2)
        whole = delivered_with_ids(loader)
    with AsyncLoader(shard_mix(kind, where), **kwargs) as loader:
        loader.set_epoch(2)
        head = delivered_with_ids(loader, batches=3)
        state = json.loads(json.dumps(loader.state_dict()))
    with AsyncLoader(shard_mix(kind, where), **kwargs) as loader:
        loader.load_state_dict(state)
        rest = delivered_with_ids(loader)
    assert head == whole[:12] and rest == whole[12:]
    with AsyncLoader(shard_mix(kind, where, shuffle_buffer=2), **kwargs) as changed:
        with pytest.raises(ValueError, match="mix"):
            changed.load_state_dict(state)  # another shuffle buffer: another order


def test_each_source_of_a_shard_mix_comes_in_its_shard_order(two_shard_sets):
    """Within a source, shards one after another (then a buffer shuffle, here of one sample):
    neighbouring draws of a source share a shard, so a run reads few shards at once."""
    mixed = shard_mix("tar", two_shard_sets, shuffle_buffer=1)
    sequence = mixed.sequence(epoch=0)
    assert sorted(sequence.tolist()) == list(range(2 * HALF))
    for number in range(2):
        shards = mixed.shard_of[sequence[mixed.source_of(sequence) == number]]
        changes = np.flatnonzero(np.diff(shards)) + 1
        assert len(changes) == 2 and len(set(shards.tolist())) == 3  # each of its 3 shards in one stretch
    assert not np.array_equal(sequence, mixed.sequence(epoch=1))


def test_ranks_take_contiguous_disjoint_parts_of_a_shard_mix(two_shard_sets):
    mixed = shard_mix("tar", two_shard_sets)
    with AsyncLoader(mixed, batch_size=4, decode=ImageDecoder(16), rank=0, world_size=2) as first, \
            AsyncLoader(mixed, batch_size=4, decode=ImageDecoder(16), rank=1, world_size=2) as second:
        orders = [first.sampler.order(0), second.sampler.order(0)]
        sequence = first.sampler.permutation(0)
        assert np.array_equal(np.concatenate(orders), sequence)
        assert sorted(delivered_with_ids(first) + delivered_with_ids(second)) == expected_images()


def test_a_mix_at_another_world_size_is_refused_when_its_states_are_loaded():
    """Elastic resume of a mix is not supported: the states are refused at load_state_dict, so
    the epoch they describe is not lost by a pass that fails at iter() and moves on."""
    mixed = mix({"a": list(range(0, 40)), "b": list(range(100, 140))}, {"a": 1, "b": 1})
    states = []
    for rank in range(2):
        with AsyncLoader(mixed, batch_size=4, read=False, decode=as_array, rank=rank, world_size=2) as loader:
            batches = iter(loader)
            next(batches)
            states.append(loader.state_dict())
    with AsyncLoader(mixed, batch_size=4, read=False, decode=as_array, rank=0, world_size=1) as loader:
        with pytest.raises(ValueError, match="resuming a mixed source at another world size is not supported"):
            loader.load_state_dict(states)
        assert loader.state_dict()["epoch"] == 0 and loader.state_dict()["delivered"] == []
