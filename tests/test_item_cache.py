"""The disk cache of item sources (cache/items.py): image_folder, list_files and manifest on the
real S3 server keep each object read once in cache_dir, so epoch 2 reads no byte from the bucket;
and the shard cache's safety rules hold for item objects (a damaged copy, a full disk, a planted
symlink, storage down)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch

from asyncload import AsyncLoader, ImageDecoder, image_folder, list_files, manifest
from asyncload.cache.item_files import FILE_MAGIC, SegmentStore
from tests.conftest import CLASSES, PER_CLASS, delivered, flat, identify, make_bucket, setup_s3fs
from tests.test_cache import closed_port_options, small_disk  # noqa: F401 (a fixture)

ALL = [(label, index) for label in range(len(CLASSES)) for index in range(PER_CLASS)]  # the sorted listing's order
DECODE = ImageDecoder(32)


@pytest.fixture()
def bucket(s3_options, jpeg_folder, request):
    """``(url, s3fs, prefix)``: the test JPEGs under a prefix of this test's own."""
    prefix = f"asyncload-test/item-cache/{request.node.name.replace('[', '-').strip(']')}"
    with setup_s3fs(s3_options) as fs:
        make_bucket(fs)
        fs.pipe({f"{prefix}/{p.relative_to(jpeg_folder).as_posix()}": p.read_bytes()
                 for p in sorted(jpeg_folder.rglob("*.jpg"))})
        yield f"s3://{prefix}", fs, prefix


def make_source(kind: str, url: str, options: dict, cache: Path, tmp_path: Path, **kwargs):
    if kind == "image_folder":
        return image_folder(url, storage_options=options, cache_dir=str(cache), **kwargs)
    if kind == "list_files":
        return list_files(url, storage_options=options, cache_dir=str(cache), **kwargs)
    lines = [f"{url}/{CLASSES[label]}/{index}.jpg\t{label}" for label, index in ALL]
    (tmp_path / "train.tsv").write_text("\n".join(lines) + "\n")
    return manifest(str(tmp_path / "train.tsv"), cache_dir=str(cache), **kwargs)


def epochs(source, options, processes=0, count=2, **kwargs) -> tuple[list, list]:
    """Each epoch's samples in order (shuffle off) and the bytes and reads it took from storage."""
    samples, reads = [], []
    with AsyncLoader(source, batch_size=5, decode=DECODE, storage_options=options, processes=processes,
                     shuffle=False, **kwargs) as loader:
        before = loader.stats.as_dict()
        for _ in range(count):
            if source.labels is not None:
                samples.append(flat(delivered(loader)))
            else:
                samples.append([identify(image.numpy()) for images in loader for image in images])
            after = loader.stats.as_dict()
            reads.append((after["read/bytes"] - before["read/bytes"], after["read/items"] - before["read/items"]))
            before = after
    return samples, reads


def kept(cache: Path) -> dict[str, bytes]:
    """url -> the bytes the cache keeps for it, as a new process finds them."""
    store = SegmentStore(cache, 1 << 30)
    try:
        store.refresh()
        return {url: store.read(entry) for url, entry in store.entries.items()}
    finally:
        store.close()


def segments(cache: Path) -> list[Path]:
    return sorted(p for p in cache.iterdir() if p.name.startswith("asyncload-items-") and p.is_file()
                  and not p.is_symlink())


@pytest.mark.parametrize("processes", [0, 2])
@pytest.mark.parametrize("kind", ["image_folder", "list_files", "manifest"])
def test_epoch_two_reads_no_byte_from_the_bucket(bucket, s3_options, tmp_path, kind, processes):
    url, fs, _ = bucket
    source = make_source(kind, url, s3_options, tmp_path / "cache", tmp_path)
    samples, reads = epochs(source, s3_options, processes)
    assert samples == [ALL, ALL]  # every sample once, in order, each epoch
    assert reads[0][1] == len(ALL) and reads[0][0] > 0
    assert reads[1] == (0, 0)
    assert kept(tmp_path / "cache") == {source.url(i): fs.cat_file(source.url(i)) for i in range(len(ALL))}
    # packed: a segment per process that wrote (a file, a record and a lock per object before)
    assert set((tmp_path / "cache").iterdir()) == set(segments(tmp_path / "cache"))
    assert len(segments(tmp_path / "cache")) <= max(processes, 1)


def test_a_new_run_reads_the_copies_and_a_rewritten_object_again(bucket, s3_options, tmp_path):
    """A second loader (a new run) reads the kept copies; one whose object was rewritten since
    (its listing's ETag differs, its size does not) is downloaded again, and its new bytes are
    what is delivered."""
    url, fs, prefix = bucket
    source = make_source("image_folder", url, s3_options, tmp_path / "cache", tmp_path)
    epochs(source, s3_options, count=1)
    old, new = fs.cat_file(f"{prefix}/cat/0.jpg"), fs.cat_file(f"{prefix}/cat/1.jpg")
    assert len(new) <= len(old)
    fs.pipe_file(f"{prefix}/cat/0.jpg", new + bytes(len(old) - len(new)))  # after its end marker: ignored
    source = make_source("image_folder", url, s3_options, tmp_path / "cache", tmp_path)
    samples, reads = epochs(source, s3_options, count=1)
    assert samples == [[(0, 1)] + ALL[1:]]  # cat/0.jpg now holds cat/1's image
    assert reads == [(len(fs.cat_file(f"{prefix}/cat/0.jpg")), 1)]


@pytest.mark.parametrize("processes", [0, 2])
def test_a_damaged_copy_is_downloaded_again(bucket, s3_options, tmp_path, processes):
    url, fs, _ = bucket
    cache = tmp_path / "cache"
    source = make_source("image_folder", url, s3_options, cache, tmp_path)
    epochs(source, s3_options, count=1)
    store = SegmentStore(cache, 1 << 30)
    store.refresh()
    entry = store.entries[source.url(3)]
    damaged = store.segments[entry.segment].path
    store.close()
    stat = damaged.stat()
    with open(damaged, "r+b") as segment:  # bit rot in one object: same size and time
        segment.seek(entry.offset + entry.size // 2)
        byte = segment.read(1)
        segment.seek(entry.offset + entry.size // 2)
        segment.write(bytes([byte[0] ^ 0xFF]))
    os.utime(damaged, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    samples, reads = epochs(source, s3_options, processes, count=1)
    assert samples == [ALL]
    assert reads == [(entry.size, 1)]
    assert kept(cache)[source.url(3)] == fs.cat_file(source.url(3))


def test_a_planted_symlink_is_not_followed(bucket, s3_options, tmp_path):
    """A symlink named as a segment (a peer's, or an attacker's) is neither read, written
    through nor deleted, even when it points at a well-formed segment that holds other bytes
    for an object: the objects are read from the bucket, and the link's target is left as it was."""
    url, _, _ = bucket
    cache, elsewhere = tmp_path / "cache", tmp_path / "elsewhere"
    source = make_source("image_folder", url, s3_options, cache, tmp_path)
    store = SegmentStore(elsewhere, 1 << 30)
    elsewhere.mkdir()
    size, version = source.listed(0)
    store.append([(source.url(0), version, b"\xff" * size)])  # listed size and version, not a JPEG
    store.close()
    (outside,) = segments(elsewhere)
    planted = outside.read_bytes()
    cache.mkdir()
    (cache / outside.name).symlink_to(outside)
    samples, _ = epochs(source, s3_options, count=2)
    assert samples == [ALL, ALL]
    assert outside.read_bytes() == planted and (cache / outside.name).is_symlink()


@pytest.mark.parametrize("processes", [0, 2])
def test_a_full_disk_sends_reads_to_storage(bucket, s3_options, small_disk, processes):
    url, fs, _ = bucket
    (small_disk / "filler").write_bytes(bytes(24 << 10))  # a user's file: 8 KiB left, less than the objects
    source = make_source("image_folder", url, s3_options, small_disk, small_disk, cache_bytes=1 << 30)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        samples, reads = epochs(source, s3_options, processes, count=2)
    assert samples == [ALL, ALL]
    assert reads[1][1] > 0  # what did not fit is read from storage, not lost
    assert all(data == fs.cat_file(url) for url, data in kept(small_disk).items())  # no torn record served
    assert (small_disk / "filler").read_bytes() == bytes(24 << 10)


def test_storage_down_serves_the_kept_copies(bucket, s3_options, tmp_path):
    """A manifest's items are asked about once per process; with storage down, a new run
    serves the copies whose checksum holds (with a warning), every sample once."""
    url, _, _ = bucket
    source = make_source("manifest", url, s3_options, tmp_path / "cache", tmp_path)
    epochs(source, s3_options, count=1)
    with pytest.warns(RuntimeWarning, match="could not be asked"):
        samples, reads = epochs(source, closed_port_options(), count=1, read_retries=0)
    assert samples == [ALL] and reads == [(0, 0)]


def test_cache_bytes_bounds_the_folder(bucket, s3_options, tmp_path):
    """Least recently used copies go once the folder would pass cache_bytes; files that are not
    the cache's stay."""
    url, _, _ = bucket
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "notes.txt").write_text("mine")
    lookalike = cache / f"asyncload-items-{'0' * 32}.seg"  # named as ours, not written by us
    lookalike.write_bytes(b"a user's file" * 1000)
    os.utime(lookalike, ns=(0, 0))  # the least recently used of all
    source = make_source("image_folder", url, s3_options, cache, tmp_path, cache_bytes=8_000)
    samples, _ = epochs(source, s3_options, count=2)
    assert samples == [ALL, ALL]
    assert sum(p.stat().st_size for p in segments(cache) if p != lookalike) <= 8_000
    assert (cache / "notes.txt").read_text() == "mine"
    assert lookalike.read_bytes() == b"a user's file" * 1000


def test_a_batched_decoder_decodes_the_kept_copies(bucket, s3_options, tmp_path):
    """A hit is read by the decode thread (no trip through the loop), for a batched decoder
    (``GpuImageDecoder``, through nvImageCodec's CPU backend) as for a per-row one: epoch 2 reads
    nothing from the bucket and gives epoch 1's pixels."""
    pytest.importorskip("nvidia.nvimgcodec")
    from asyncload.decode.gpu import GpuImageDecoder

    url, _, _ = bucket
    source = make_source("image_folder", url, s3_options, tmp_path / "cache", tmp_path)
    decode = GpuImageDecoder(32, device="cpu")
    with AsyncLoader(source, batch_size=5, decode=decode, storage_options=s3_options, processes=0,
                     shuffle=False) as loader:
        first = [(images.clone(), labels.clone()) for images, labels in loader]
        before = loader.stats.as_dict()
        second = [(images.clone(), labels.clone()) for images, labels in loader]
        after = loader.stats.as_dict()
    assert len(first) == len(second) == 5
    for (images, labels), (again, labels_again) in zip(first, second):
        assert torch.equal(images, again) and torch.equal(labels, labels_again)
    assert after["read/items"] == before["read/items"] and after["read/bytes"] == before["read/bytes"]


@pytest.mark.parametrize("kind", ["manifest", "image_folder"])
def test_a_second_pass_asks_storage_nothing_and_parses_no_segment(bucket, s3_options, tmp_path, monkeypatch, kind):
    """Each pass in this process built a new item cache: it parsed every segment's records
    again and asked storage again about every unlisted object (a metadata request each, as many
    as the GETs the cache saves). Now what the first pass learnt serves the next."""
    from asyncload.io.reader import Reader

    url, _, _ = bucket
    asked, parsed = [], []
    real_version, real_parse = Reader.version, SegmentStore._parse

    async def version(self, key):
        asked.append(key)
        return await real_version(self, key)

    def parse(self, *args):
        parsed.append(args[0])
        return real_parse(self, *args)

    monkeypatch.setattr(Reader, "version", version)
    monkeypatch.setattr(SegmentStore, "_parse", parse)
    source = make_source(kind, url, s3_options, tmp_path / "cache", tmp_path)
    counts = []
    with AsyncLoader(source, batch_size=5, decode=DECODE, storage_options=s3_options, shuffle=False) as loader:
        for _ in range(2):
            asked.clear()
            parsed.clear()
            assert flat(delivered(loader)) == ALL
            counts.append((len(asked), len(parsed), loader.stats.as_dict()["read/items"]))
    assert counts[0][:2] == (len(ALL) if kind == "manifest" else 0, 0)
    assert counts[1] == (0, 0, len(ALL))  # nothing asked, nothing parsed, nothing downloaded again


def test_between_passes_no_descriptor_holds_a_segment_a_peer_evicts(bucket, s3_options, tmp_path):
    """The index kept for the loader's next pass kept its segments' descriptors open too: a peer
    (another rank, this loader's children, a second loader) that evicted those segments while
    this loader waited between passes (validation, or a loader kept after its last epoch) freed
    no disk, up to MAX_OPEN segments of 64 MiB held deleted for the loader's life. The index
    stays; a descriptor is opened again at the next read (the segment's inode checked)."""
    url, _, _ = bucket
    cache = tmp_path / "cache"
    source = make_source("image_folder", url, s3_options, cache, tmp_path)

    def held() -> list[str]:
        names = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                names.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                pass
        return [name for name in names if "asyncload-items-" in name]

    with AsyncLoader(source, batch_size=5, decode=DECODE, storage_options=s3_options, shuffle=False) as loader:
        for _ in range(2):  # cold, then warm: the warm pass reads through the kept descriptors
            assert flat(delivered(loader)) == ALL
        assert segments(cache)
        assert held() == []
        for path in segments(cache):  # a peer's eviction
            path.unlink()
        assert flat(delivered(loader)) == ALL  # downloaded again
        assert held() == []
    assert held() == []
