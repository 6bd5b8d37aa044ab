import pytest

from asyncload import Source, image_folder, list_files, manifest
from tests.conftest import CLASSES, PER_CLASS


def test_image_folder_labels_follow_sorted_class_folders(jpeg_folder):
    source = image_folder(str(jpeg_folder))
    assert source.classes == list(CLASSES)
    assert len(source) == len(CLASSES) * PER_CLASS
    for url, label in source:
        assert url.startswith(str(jpeg_folder))
        assert url.split("/")[-2] == CLASSES[label]


def test_image_folder_ignores_files_at_the_root_and_other_extensions(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.JPG").write_bytes(b"")
    (tmp_path / "a" / "notes.txt").write_text("")
    (tmp_path / "loose.jpg").write_bytes(b"")
    source = image_folder(str(tmp_path))
    assert list(source) == [(str(tmp_path / "a" / "x.JPG"), 0)]


EXTENSIONS = ".jpg, .jpeg, .png, .webp, .bmp, .tif, .tiff"


def raised(kind: type[Exception], call, *args, **kwargs) -> str:
    """The message of the ``kind`` error ``call(*args, **kwargs)`` raises."""
    with pytest.raises(kind) as caught:
        call(*args, **kwargs)
    return str(caught.value)


def test_a_missing_folder_is_not_found_and_one_without_images_a_value_error(tmp_path):
    """As torchvision's ImageFolder, not an empty source that a loader would run through silently."""
    missing, folder = tmp_path / "no-such-folder", tmp_path / "a"
    assert raised(FileNotFoundError, image_folder, str(missing)) == (
        f"{missing}: no such folder (looked for class folders holding files ending in {EXTENSIONS})")
    assert raised(FileNotFoundError, list_files, str(missing), extensions=(".npy",)) == (
        f"{missing}: no such folder (looked for files ending in .npy)")
    folder.mkdir()
    top_level = "only 1 at its top level, in no class folder"
    for added, found in ((None, "none"), ("notes.txt", "none"), ("loose.jpg", top_level)):
        if added:
            (folder / added).write_bytes(b"")
        assert raised(ValueError, image_folder, str(folder)) == (
            f"{folder}: looked for class folders holding files ending in {EXTENSIONS} (<class>/<file>), found {found}")
    assert raised(ValueError, list_files, str(folder), extensions=(".png",)) == (
        f"{folder}: looked for files ending in .png, found none")


def test_a_missing_or_empty_manifest(tmp_path):
    path = tmp_path / "m.tsv"
    assert raised(FileNotFoundError, manifest, str(path)) == f"manifest {path} not found"
    path.write_text("\n  \n")
    assert raised(ValueError, manifest, str(path)) == (
        f"manifest {path} lists no item (expected one 'url' or 'url<TAB>label' a line)")


def test_list_files_has_no_labels(jpeg_folder):
    source = list_files(str(jpeg_folder))
    assert len(source) == len(CLASSES) * PER_CLASS and isinstance(source[0], str)


def test_source_indexing():
    source = Source(["a", "bé", "c"], [0, 1, 2])
    assert source[1] == ("bé", 1) and source[-1] == ("c", 2)
    with pytest.raises(IndexError):
        source[3]


def test_manifest_with_and_without_labels(tmp_path):
    (tmp_path / "labelled.tsv").write_text("s3://b/x.jpg\t3\ns3://b/y.jpg\t0\n")
    (tmp_path / "plain.txt").write_text("s3://b/x.jpg\n\ns3://b/y.jpg\n")
    assert list(manifest(str(tmp_path / "labelled.tsv"))) == [("s3://b/x.jpg", 3), ("s3://b/y.jpg", 0)]
    assert list(manifest(str(tmp_path / "plain.txt"))) == ["s3://b/x.jpg", "s3://b/y.jpg"]


def test_manifest_with_a_bad_line_names_it(tmp_path):
    (tmp_path / "bad.csv").write_text("x.jpg,1\ny.jpg,one\n")
    with pytest.raises(ValueError, match="y.jpg,one"):
        manifest(str(tmp_path / "bad.csv"))


def test_image_folder_on_a_bucket_prefix(s3_jpeg_bucket, s3_options, jpeg_folder):
    remote = image_folder(s3_jpeg_bucket, storage_options=s3_options)
    local = image_folder(str(jpeg_folder))
    assert remote.classes == local.classes
    assert [label for _, label in remote] == [label for _, label in local]
    assert remote[0][0] == "s3://asyncload-test/jpegs/cat/0.jpg"


@pytest.fixture
def http_folder(tmp_path):
    """``tmp_path`` served over HTTP on 127.0.0.1 (fsspec's http filesystem: aiohttp sessions)."""
    import functools
    import http.server
    import threading

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(tmp_path)))
    thread = threading.Thread(target=server.serve_forever, name="http-folder")
    thread.start()
    try:
        yield tmp_path, f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_reading_a_manifest_leaves_the_users_own_filesystem_open(http_folder):
    """A listing closes the session of the filesystem it made for itself, never one fsspec
    caches for the user: a chained URL's inner filesystem is fsspec's cached instance."""
    import fsspec

    folder, url = http_folder
    (folder / "m.txt").write_text("s3://b/0.jpg\t0\ns3://b/1.jpg\t1\n")
    users = fsspec.filesystem("http")
    assert users.cat_file(f"{url}/m.txt")
    for listed in (f"{url}/m.txt", f"simplecache::{url}/m.txt", f"simplecache::{url}/m.txt"):
        assert list(manifest(listed)) == [("s3://b/0.jpg", 0), ("s3://b/1.jpg", 1)], listed
    assert users.cat_file(f"{url}/m.txt").startswith(b"s3://b/0.jpg")


def test_a_manifest_drops_a_byte_order_mark_and_splits_lines_only_at_newlines(tmp_path):
    """A BOM was kept in the first URL; U+2028, U+0085 and a form feed (valid in object names)
    split a URL in two; CRLF line ends are fine."""
    path = tmp_path / "m.tsv"
    path.write_bytes("\ufeffs3://b/a.jpg\t1\r\ns3://b/x\u2028y.jpg\t2\ns3://b/p\x85q\x0cr.jpg\t0\n".encode())
    assert list(manifest(str(path))) == [("s3://b/a.jpg", 1), ("s3://b/x\u2028y.jpg", 2), ("s3://b/p\x85q\x0cr.jpg", 0)]


def test_a_manifest_with_a_nul_byte_is_refused_naming_the_line(tmp_path):
    path = tmp_path / "m.txt"
    path.write_bytes(b"s3://b/a.jpg\n\ns3://b/b\x00.jpg\n")
    assert raised(ValueError, manifest, str(path)) == (
        f"manifest {path}: line 3 holds a NUL byte (a binary file, or not UTF-8 text?)")


def test_a_bad_manifest_line_is_named_by_number_and_cut_short(tmp_path):
    (tmp_path / "bad.csv").write_text("x.jpg,1\n" + "y" * 500 + ".jpg,one\n")
    message = raised(ValueError, manifest, str(tmp_path / "bad.csv"))
    assert message.endswith("yyy... on line 2") and len(message) < 300


def test_a_bad_manifest_line_shows_no_secret(tmp_path):
    (tmp_path / "bad.csv").write_text("x.jpg,1\nhttps://h/y.jpg?X-Amz-Signature=5ecret0123,one\n")
    message = raised(ValueError, manifest, str(tmp_path / "bad.csv"))
    assert "5ecret0123" not in message and "y.jpg?X-Amz-Signature=***" in message, message
