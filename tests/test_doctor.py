"""python -m asyncload.doctor: loads a real source for a while and says what limits it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncload import image_folder, write_shards
from tests.support.s3server import free_port
from tests.conftest import CLASSES, PER_CLASS

ROOT = Path(__file__).resolve().parents[1]


def doctor(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # keep where packages are
    return subprocess.run([sys.executable, "-m", "asyncload.doctor", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": path, **(env or {})})


def test_the_doctor_names_the_stages_the_bottleneck_a_setting_and_the_trace(jpeg_folder, tmp_path):
    trace = tmp_path / "run.json"
    done = doctor(str(jpeg_folder), "--seconds", "1", "--batch-size", "8", "--trace", str(trace))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"asyncload doctor: {jpeg_folder}: {len(CLASSES) * PER_CLASS} samples; loading for 1 s ..."
    assert any(line.startswith("read ") for line in lines) and any(line.startswith("decode ") for line in lines)
    assert any(line.startswith("bottleneck: ") for line in lines)
    assert any(line.startswith("suggested: ") for line in lines)
    assert lines[-1].startswith(f"trace: {trace} (open it in")
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(1 for e in events if e["ph"] == "X" and e["name"] == "decode") >= len(CLASSES) * PER_CLASS


def test_the_doctor_reads_tar_shards_and_buckets(jpeg_folder, tmp_path, s3_jpeg_bucket, s3_options):
    write_shards(image_folder(str(jpeg_folder)), str(tmp_path / "shards"), samples_per_shard=5)
    done = doctor(str(tmp_path / "shards"), "--seconds", "0.5", "--batch-size", "8", "--trace", str(tmp_path / "a.json"))
    assert done.returncode == 0, done.stderr
    assert f"shards: {len(CLASSES) * PER_CLASS} samples; loading" in done.stdout
    options = tmp_path / "s3.json"  # credentials in a file, not on the command line
    options.write_text(json.dumps(s3_options))
    done = doctor(s3_jpeg_bucket, "--seconds", "0.5", "--batch-size", "8", "--trace", str(tmp_path / "b.json"),
                  "--options", str(options))
    assert done.returncode == 0, done.stderr
    assert f"{s3_jpeg_bucket}: {len(CLASSES) * PER_CLASS} samples" in done.stdout
    assert "reads in flight" in done.stdout


def test_a_source_that_is_not_there_gets_one_line_not_a_traceback(tmp_path):
    done = doctor(str(tmp_path / "missing"), "--seconds", "1")
    assert done.returncode == 2
    assert done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and str(tmp_path / "missing") in done.stderr


SECRET = "s3cr3t-doctor-value-42"


@pytest.mark.parametrize("given", ["file", "environment"])
def test_an_unreachable_endpoint_is_one_line_and_exit_2(tmp_path, given):
    """Credentials from a file or the environment; storage at a port nobody listens on: one line
    naming the cause, without the secret, and no traceback (listed, then read: one try each)."""
    options = {"endpoint_url": f"http://127.0.0.1:{free_port()}", "key": "doctor", "secret": SECRET,
               "retry_config": {"max_retries": 0}}
    if given == "file":
        (tmp_path / "options.json").write_text(json.dumps(options))
        done = doctor("s3://asyncload-test/jpegs", "--options", str(tmp_path / "options.json"))
    else:
        done = doctor("s3://asyncload-test/jpegs", env={"ASYNCLOAD_STORAGE_OPTIONS": json.dumps(options)})
    assert done.returncode == 2, done.stderr
    origin = f"--options {tmp_path / 'options.json'}" if given == "file" else "$ASYNCLOAD_STORAGE_OPTIONS"
    assert done.stdout == (f"asyncload doctor: storage options from {origin}: {{'endpoint_url': "
                           f"'{options['endpoint_url']}', 'key': '***', 'secret': '***', 'retry_config': "
                           f"{{'max_retries': 0}}}}\n"), "what was taken, without its secrets"
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith("asyncload doctor: ") and "(Connection refused)" in done.stderr, done.stderr
    assert SECRET not in done.stderr + done.stdout


def test_switches_on_the_command_line_are_no_secrets(jpeg_folder, tmp_path):
    """gcsfs's token="anon" and obstore's skip_signature name no credential (and local files
    ignore them)."""
    done = doctor(str(jpeg_folder), "--seconds", "0.2", "--trace", str(tmp_path / "t.json"),
                  "--storage-options", json.dumps({"token": "anon", "skip_signature": True}))
    assert done.returncode == 0, done.stderr


def test_credentials_on_the_command_line_are_refused_without_being_echoed():
    done = doctor("s3://asyncload-test/jpegs", "--storage-options", json.dumps({"anon": False, "secret": SECRET}))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == ("asyncload doctor: --storage-options may not hold secret (a command line shows in ps and "
                           "the shell's history): put them in --options FILE or $ASYNCLOAD_STORAGE_OPTIONS\n")
