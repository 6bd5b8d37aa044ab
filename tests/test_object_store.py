"""Which client serves a URL, and fsspec-style options as obstore's (no server needed: obstore
builds a store without sending a request)."""

from __future__ import annotations

import asyncio
import threading
from datetime import timedelta

import pytest

from asyncload.io import object_store
from asyncload.io.object_store import client_for
from asyncload.io.reader import Reader
from asyncload.stats.loader_stats import LoaderStats

pytest.importorskip("obstore")


def test_object_stores_default_to_obstore_and_the_rest_to_fsspec():
    assert [client_for(p, {})[0] for p in ("s3", "s3a", "gs", "gcs")] == ["obstore"] * 4
    assert [client_for(p, {"account_name": "a"})[0] for p in ("az", "abfs")] == ["obstore"] * 2
    assert [client_for(p, {"client": "obstore"})[0] for p in ("file", "memory", "http")] == ["fsspec"] * 3
    assert client_for("s3", {"client": "fsspec", "key": "k"}) == ("fsspec", {"key": "k"})


def test_s3fs_names_are_translated():
    client, settings = client_for("s3", {
        "endpoint_url": "http://127.0.0.1:9000", "key": "k", "secret": "s", "token": "t", "requester_pays": True,
        "client_kwargs": {"region_name": "eu-west-1", "verify": False}, "skip_instance_cache": True,
        "config_kwargs": {"max_pool_connections": 64, "connect_timeout": 3, "s3": {"addressing_style": "virtual"}},
    })
    assert client == "obstore"
    assert settings["config"] == {"endpoint": "http://127.0.0.1:9000", "access_key_id": "k", "secret_access_key": "s",
                                  "token": "t", "request_payer": True, "region": "eu-west-1",
                                  "virtual_hosted_style_request": True}
    assert settings["client_options"] == {"allow_http": True, "allow_invalid_certificates": True,
                                          "connect_timeout": timedelta(seconds=3)}
    assert client_for("s3", {"anon": True, "region": "us-west-2"})[1]["config"] == {"skip_signature": True, "region": "us-west-2"}


def test_what_obstore_cannot_serve_goes_to_fsspec_unless_obstore_is_chosen():
    for options in ({"use_ssl": False}, {"s3_additional_kwargs": {"ACL": "private"}},
                    {"client_kwargs": {"proxies": {}}}, {"client_kwargs": {"verify": "/etc/ssl/ca.pem"}},
                    {"config_kwargs": {"signature_version": "s3v4"}}):
        assert client_for("s3", options) == ("fsspec", options)
        with pytest.raises(ValueError, match="obstore cannot serve"):
            client_for("s3", {**options, "client": "obstore"})
    assert client_for("gs", {"token": "cache"})[0] == "fsspec"


def test_unknown_options_and_clients_are_named():
    with pytest.raises(ValueError, match=r"storage option 'secrett' is not valid for s3://"):
        client_for("s3", {"secrett": "x"})
    with pytest.raises(ValueError, match=r"storage option config\['bogus'\] is not valid"):
        client_for("s3", {"config": {"bogus": 1}})
    with pytest.raises(ValueError, match=r"storage option client_options\['bogus'\] is not valid"):
        client_for("s3", {"client_options": {"bogus": 1}})
    with pytest.raises(ValueError, match="storage_options\\['client'\\] must be one of 'auto', 'obstore', 'fsspec', got 'boto3'"):
        client_for("s3", {"client": "boto3"})


def test_gcs_and_azure_names_are_translated(tmp_path):
    assert client_for("gs", {"token": "anon", "project": "p"})[1]["config"] == {"skip_signature": True}
    assert client_for("gs", {"token": "google_default", "project": "p"})[1]["config"] == {}
    credentials = tmp_path / "sa.json"
    credentials.write_text('{"type": "authorized_user", "client_id": "c", "client_secret": "s", "refresh_token": "r"}')
    assert client_for("gs", {"token": str(credentials)})[1]["config"] == {"application_credentials": str(credentials)}
    assert client_for("az", {"account_name": "acct", "anon": True})[1]["config"] == {"account_name": "acct", "skip_signature": True}


@pytest.mark.parametrize("protocol, options", [("gs", {"token": "anon"}), ("gcs", {"token": "anon"}),
                                               ("s3a", {"anon": True, "region": "us-east-1"}),
                                               ("abfs", {"account_name": "acct", "anon": True}),
                                               ("abfss", {"account_name": "acct", "anon": True})])
def test_every_alias_of_a_scheme_builds_its_store(protocol, options):
    """fsspec's other names for a scheme (gcs://, s3a://, abfs://) reach obstore under its own
    name (object_store knows only gs://, s3://, az://); building a store sends no request."""
    fs, path = object_store.url_to_fs(f"{protocol}://bucket/a.jpg", options)
    assert object_store.is_obstore(fs) and path == "bucket/a.jpg"
    assert fs._construct_store("bucket") is not None
    object_store.release(fs)


def test_no_aws_files_no_boto3_provider(tmp_path, monkeypatch):
    """Without ``~/.aws`` or a profile, object_store's own chain (environment, web identity,
    instance metadata) finds credentials: boto3 is not asked."""
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    assert "credential_provider" not in client_for("s3", {})[1]
    assert object_store.has_obstore()


class RegionServer:
    """Answers every HEAD as S3 does for a bucket in another region: 301 with its region; with
    ``answer_when``, only once that event is set (60 s at most), after setting ``asked``."""

    def __init__(self, region: str, answer_when: threading.Event | None = None) -> None:
        import http.server

        self.asked = asked = threading.Event()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_HEAD(self) -> None:  # noqa: N802 - http.server's name
                self.server.paths.append(self.path)
                if answer_when is not None:
                    asked.set()
                    answer_when.wait(60)
                self.send_response(301)
                self.send_header("x-amz-bucket-region", region)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.paths = []
        self.thread = threading.Thread(target=self.server.serve_forever, name="region-server")

    def __enter__(self) -> "RegionServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def no_region_anywhere(monkeypatch, tmp_path) -> None:
    for name in ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT", "AWS_ENDPOINT_URL", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))


def test_a_buckets_region_is_asked_when_nothing_sets_it(monkeypatch, tmp_path):
    """object_store assumes us-east-1 where s3fs finds the bucket's region: asked once per bucket,
    only when no option, variable or profile names a region or an endpoint."""
    no_region_anywhere(monkeypatch, tmp_path)
    object_store._regions.clear()
    with RegionServer("eu-west-3") as server:
        monkeypatch.setattr(object_store, "AWS_BUCKET_REGION_URL", f"http://127.0.0.1:{server.server.server_port}/{{bucket}}")
        fs = object_store.filesystem("s3", {"anon": True})
        assert fs._construct_store("far-bucket").config["region"] == "eu-west-3"
        fs._construct_store.cache_clear()
        assert fs._construct_store("far-bucket").config["region"] == "eu-west-3"
        assert server.server.paths == ["/far-bucket"], "asked once"
        fs = object_store.filesystem("s3", {"anon": True, "region": "us-west-2"})
        assert fs._construct_store("other-bucket").config["region"] == "us-west-2"
        monkeypatch.setenv("AWS_REGION", "ap-south-1")  # object_store reads it itself
        assert "region" not in object_store.filesystem("s3", {"anon": True})._construct_store("third").config
        assert server.server.paths == ["/far-bucket"]
    object_store._regions.clear()


def test_the_region_lookup_never_stalls_the_event_loop(monkeypatch, tmp_path):
    """The store's constructor asked S3 for the region in a blocking HEAD (up to 5 s) from the
    reader's event loop, where every other read waited meanwhile. The reader now asks on an
    I/O thread first: the loop keeps turning. The region server answers only once a ticker on
    the loop has ticked 3 times after the HEAD arrived: a lookup that held the loop would meet
    no tick, time out, and learn no region, however busy the machine."""
    no_region_anywhere(monkeypatch, tmp_path)
    object_store._regions.clear()
    ticked = threading.Event()

    async def read_beside_a_ticker(server: RegionServer) -> BaseException | None:
        reader = Reader(asyncio.get_running_loop(), storage_options={"anon": True}, timeout=30.0, retries=0,
                        io_concurrency=4, stats=LoaderStats())

        async def tick() -> None:
            ticks = 0
            while True:
                await asyncio.sleep(0.01)
                ticks += server.asked.is_set()
                if ticks >= 3:
                    ticked.set()

        ticker = asyncio.ensure_future(tick())
        try:
            await reader.read("s3://slow-region-bucket/key")  # the GET itself cannot reach AWS here
            error = None
        except Exception as failure:  # whatever the network says; the loop is what is checked
            error = failure
        ticker.cancel()
        await reader.aclose()
        return error

    with RegionServer("eu-west-3", answer_when=ticked) as server:
        monkeypatch.setattr(object_store, "AWS_BUCKET_REGION_URL", f"http://127.0.0.1:{server.server.server_port}/{{bucket}}")
        asyncio.run(read_beside_a_ticker(server))
        assert server.server.paths == ["/slow-region-bucket"], "asked once"
    assert ticked.is_set(), "the event loop stood still while the region was asked"
    assert object_store._regions["slow-region-bucket"] == "eu-west-3", "answered while the loop went on"
    object_store._regions.clear()
