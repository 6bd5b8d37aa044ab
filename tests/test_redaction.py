"""No secret in what the loader writes: messages, ``stats.failures``, ``stats.report()``, the
trace, the pickling check. Each test hides a recognisable credential where users' credentials
turn up (a presigned URL, a token echoed by a client, ``storage_options``) and looks for it in
every text the loader makes of it."""

from __future__ import annotations

import pickle
import re

import numpy as np
import pytest

from asyncload import AsyncLoader, SampleError, StorageError, TooManyFailures, image_folder
from asyncload.io.object_store import client_for
from asyncload.redact import redact, redact_options, shown
from tests.conftest import setup_s3fs

SIGNATURE = "5e1f0c0ffee5ignature0123456789abcdef"
TOKEN = "FQoGZXIvYXdzEJrTokenValue42"
BEARER = "b3arer-t0ken-value-42"
PATH = "https://bucket.example/data/cat/3.jpg"
PRESIGNED = (f"{PATH}?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIDEXAMPLE%2F20261125%2Fus-east-1%2Fs3"
             f"%2Faws4_request&X-Amz-Date=20261125T120000Z&X-Amz-Expires=3600&X-Amz-Security-Token={TOKEN}"
             f"&X-Amz-SignedHeaders=host&X-Amz-Signature={SIGNATURE}")
SECRETS = (SIGNATURE, TOKEN, BEARER, "AKIDEXAMPLE")
ITEMS = [f"https://bucket.example/data/dog/{i}.jpg" for i in range(5)] + [PRESIGNED]


async def echoing_read(item: str) -> np.ndarray:
    """Storage that refuses the presigned item and, as some clients do, echoes the request with
    its headers in the error (module level: a child process finds it)."""
    if item == PRESIGNED:
        raise PermissionError(f"403 Forbidden for url {item}\nrequest headers: {{'Authorization': 'Bearer {BEARER}'}}")
    return np.full(2, ITEMS.index(item), np.int64)


def as_row(value: np.ndarray) -> np.ndarray:
    return value


def assert_no_secret(*texts: str) -> None:
    for text in texts:
        for secret in SECRETS:
            assert secret not in text, f"{secret!r} in {text[:500]!r}"


@pytest.mark.parametrize(
    "text, kept",
    [
        (PRESIGNED, [PATH + "?", "X-Amz-Date=20261125T120000Z", "X-Amz-Signature=***", "X-Amz-Security-Token=***"]),
        (f"https://user:{TOKEN}@host.example/a/b?a=1&sig={SIGNATURE}", ["https://***@host.example/a/b?a=1&sig=***"]),
        (f"GET http://127.0.0.1:9/b/x%3FX-Amz-Signature%3D{SIGNATURE}%26a%3D1 failed", ["x%3FX-Amz-Signature%3D***%26a%3D1"]),
        (f"headers: {{'Authorization': 'Bearer {BEARER}'}}", ["'Authorization': '***'"]),
        (f"401 with Bearer {BEARER} rejected", ["Bearer ***"]),
        (f"{{'endpoint_url': 'http://s3', 'key': 'AKIDEXAMPLE', 'secret': '{TOKEN}', 'region': 'eu'}}",
         ["'endpoint_url': 'http://s3'", "'key': '***'", "'secret': '***'", "'region': 'eu'"]),
        (f"token=ya29.{TOKEN} and aws_session_token: {SIGNATURE}", ["token=***", "aws_session_token: ***"]),
        (f"a Google token ya29.{TOKEN} alone", ["a Google token *** alone"]),
        ("Configuration key: 'aws_bucket_nam' is not valid", ["Configuration key: 'aws_bucket_nam' is not valid"]),
    ],
)
def test_redact_hides_the_values_and_keeps_the_rest(text, kept):
    redacted = redact(text)
    assert_no_secret(redacted)
    for part in kept:
        assert part in redacted, redacted


@pytest.mark.parametrize(
    "text, redacted",
    [
        ("X-Api-Key: abcd1234", "X-Api-Key: ***"),  # "Key" alone was taken for the prose "key:"
        ("token ghp_abcdefghijklmnopqrstuvwxyz0123456789 used", "token *** used"),
        # what is not a secret stays whole
        ("sample 'data/tokenizer=bpe/x.jpg' failed", "sample 'data/tokenizer=***/x.jpg' failed"),
        ("AccountName=a;AccountKey=c2VjcmV0==;EndpointSuffix=core.windows.net",
         "AccountName=a;AccountKey=***;EndpointSuffix=core.windows.net"),
        ("https://cdn/x.jpg?token=abc#frag", "https://cdn/x.jpg?token=***#frag"),
        ("Kansas=1 nasa_sas=3 sas=4", "Kansas=1 nasa_sas=*** sas=***"),
        ("private: true, private_key: 'k', session: 5", "private: true, private_key: '***', session: ***"),
        # a secret's value with '/' is hidden whole where it is no path's segment
        ("AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI/K7MDENG/bPxRfiCY", "AWS_SECRET_ACCESS_KEY=***"),
    ],
)
def test_redact_hides_whole_secrets_and_nothing_else(text, redacted):
    assert redact(text) == redacted


def test_options_show_their_keys_not_their_secrets():
    options = {"endpoint_url": "http://s3", "key": "AKIDEXAMPLE", "secret": TOKEN, "anon": False,
               "client_kwargs": {"region_name": "eu"}, "config": {"aws_session_token": TOKEN}}
    assert redact_options(options) == {"endpoint_url": "http://s3", "key": "***", "secret": "***", "anon": False,
                                       "client_kwargs": {"region_name": "eu"}, "config": {"aws_session_token": "***"}}


def test_a_huge_item_makes_a_short_message():
    key = "k" * 1_000_000
    error = SampleError(key, "read", OSError("x" * 1_000_000))
    assert len(str(error)) < 500 and len(shown(key)) == 200
    too_many = TooManyFailures([SampleError(key, "read", OSError("y" * 100_000)) for _ in range(50)], 10)
    assert len(str(too_many)) < 3000, "five failures listed, each bounded"


@pytest.mark.parametrize("processes", [0, 2])
def test_a_presigned_item_and_an_echoed_token_stay_out_of_failures_report_and_trace(tmp_path, processes):
    trace = tmp_path / "run.json"
    with AsyncLoader(ITEMS, batch_size=2, shuffle=False, read=echoing_read, decode=as_row, on_error="skip",
                     max_failures=1, trace=str(trace), processes=processes) as loader:
        rows = [int(row[0]) for batch in loader for row in batch]
    assert sorted(rows) == list(range(5))
    (failure,) = loader.stats.failures
    assert failure.item == PRESIGNED, "the item itself stays, to retry"
    assert str(failure).startswith(f"'{PATH}?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=***") and \
        "failed at read in epoch 0: PermissionError: 403 Forbidden for url" in str(failure), str(failure)
    assert_no_secret(str(failure), repr(loader.stats.failures), loader.stats.report(), trace.read_text())
    assert PATH in trace.read_text()


@pytest.mark.parametrize("processes", [0, 2])
@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_presigned_item_and_an_echoed_token_stay_out_of_the_error(processes, on_error):
    with AsyncLoader(ITEMS, batch_size=2, shuffle=False, read=echoing_read, decode=as_row, on_error=on_error,
                     max_failures=0, processes=processes) as loader:
        with pytest.raises(SampleError) as caught:
            list(loader)
    error = caught.value
    assert isinstance(error, TooManyFailures) == (on_error == "skip")
    assert PATH in str(error) and len(str(error).splitlines()) == 1, str(error)
    assert_no_secret(str(error), str(pickle.loads(pickle.dumps(error))))
    cause = error.cause.cause if isinstance(error, TooManyFailures) else error.cause
    assert BEARER in str(cause), "the client's whole text stays on the cause"


def test_a_real_presigned_url_of_a_missing_object(s3_server, s3_options):
    """A URL presigned by the S3 server's credentials, read over HTTP: fsspec's error quotes it."""
    with setup_s3fs(s3_options) as fs:
        url = fs.sign("asyncload-test/jpegs/missing.jpg", expiration=600)
    (name, signature), = [(name, value) for name, value in re.findall(r"[?&]([^=]+)=([^&]+)", url) if "Signature" in name]
    with AsyncLoader([url], batch_size=1, on_error="skip", max_failures=0, processes=0) as loader:
        with pytest.raises(SampleError) as caught:
            list(loader)
    assert "/asyncload-test/jpegs/missing.jpg?" in str(caught.value) and f"{name}=***" in str(caught.value)
    assert signature not in str(caught.value) and signature in str(caught.value.cause.cause)


def test_an_unpicklable_storage_option_is_named_without_its_secret(jpeg_folder):
    options = {"secret": TOKEN, "credential_provider": lambda: {"token": TOKEN}}
    with pytest.raises(TypeError, match="storage_options= must pickle, and its key 'credential_provider'") as caught:
        with AsyncLoader(image_folder(str(jpeg_folder)), batch_size=4, storage_options=options, processes=2) as loader:
            list(loader)
    assert_no_secret(str(caught.value))


def test_a_gcs_token_obstore_cannot_serve_is_not_echoed(tmp_path):
    """An access token string is not an option obstore takes: the error says so, without it."""
    options = {"token": f"ya29.{TOKEN}", "client": "obstore"}
    with pytest.raises(ValueError, match="obstore cannot serve token") as caught:
        client_for("gs", options)
    assert_no_secret(str(caught.value))
    trace = tmp_path / "run.json"
    with AsyncLoader(["gs://bucket/a.jpg"], batch_size=1, storage_options=options, on_error="skip", max_failures=1,
                     trace=str(trace), processes=0) as loader:
        assert list(loader) == []
    assert "failed at read in epoch 0: ValueError: storage_options: obstore cannot serve token" in str(loader.stats.failures[0])
    assert_no_secret(str(loader.stats.failures), trace.read_text())


def test_a_storage_error_hides_the_urls_credentials():
    error = StorageError(f"https://user:{TOKEN}@host/prefix?sig={SIGNATURE}", "listing", 3,
                         OSError(f"401 Unauthorized: Bearer {BEARER}\n<details>"))
    assert str(error) == "listing https://***@host/prefix?sig=*** failed after 3 attempts: OSError: 401 Unauthorized: Bearer ***"
