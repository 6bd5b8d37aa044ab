"""trace=: a Chrome trace-event JSON timeline of each run, loaded back and checked."""

from __future__ import annotations

import gc
import json
from collections import defaultdict
from pathlib import Path

import pytest

from asyncload import AsyncLoader, ImageDecoder, image_folder
from tests.conftest import CLASSES, PER_CLASS

SAMPLES = len(CLASSES) * PER_CLASS  # 24 real JPEGs
DECODE = ImageDecoder(32)


def load(path: Path) -> list[dict]:
    return json.loads(path.read_text())["traceEvents"]


def spans(events: list[dict], name: str) -> list[dict]:
    return [e for e in events if e["ph"] == "X" and e["name"] == name]


def thread_names(events: list[dict]) -> dict[tuple[int, int], str]:
    return {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}


def process_names(events: list[dict]) -> dict[int, str]:
    return {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}


def assert_nested(events: list[dict]) -> None:
    """On each thread, spans nest: one that starts inside another ends inside it too."""
    by_thread = defaultdict(list)
    for event in events:
        if event["ph"] == "X":
            by_thread[(event["pid"], event["tid"])].append((event["ts"], event["ts"] + event["dur"], event["name"]))
    for thread, items in by_thread.items():
        open_ends: list[tuple[float, str]] = []
        for start, end, name in sorted(items, key=lambda item: (item[0], -item[1])):
            while open_ends and open_ends[-1][0] <= start + 0.01:  # ends touching starts (µs, rounded)
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1][0] + 0.01, (
                f"{name} [{start}, {end}] overlaps {open_ends[-1][1]} ending {open_ends[-1][0]} on {thread}")
            open_ends.append((end, name))


@pytest.mark.parametrize("processes", [0, 2])
def test_a_span_per_sample_per_stage_on_the_threads_that_ran_them(jpeg_folder, tmp_path, processes):
    path = tmp_path / "run.json"
    with AsyncLoader(image_folder(str(jpeg_folder)), batch_size=4, decode=DECODE, trace=str(path),
                     processes=processes) as loader:
        batches = sum(1 for _ in loader)
    events = load(path)
    reads, decodes = spans(events, "read"), spans(events, "decode")
    assert len(reads) == len(decodes) == SAMPLES, "each sample read and decoded once, a span each"
    assert sorted(e["args"]["sample"] for e in decodes) == sorted(str(p) for p in jpeg_folder.rglob("*.jpg"))
    assert len(spans(events, "wait for batch")) == len(spans(events, "hand out")) == batches == SAMPLES // 4
    names = thread_names(events)
    assert {names[(e["pid"], e["tid"])] for e in decodes} <= {f"asyncload-decode-{i}" for i in range(64)}
    assert {names[(e["pid"], e["tid"])] for e in spans(events, "hand out")} == {"MainThread"}
    assert_nested(events)
    processes_named = process_names(events)
    main_pid = spans(events, "hand out")[0]["pid"]
    assert processes_named[main_pid] == "training process"
    if processes:
        children = {pid for pid, name in processes_named.items() if name.startswith("asyncload-")}
        assert sorted(processes_named[pid] for pid in children) == ["asyncload-0", "asyncload-1"]
        assert {e["pid"] for e in decodes} == children, "both children decoded, each under its own pid"
    else:
        assert {e["pid"] for e in decodes} == {main_pid}


@pytest.mark.parametrize("processes", [0, 2])
def test_failures_are_instant_events_naming_the_sample(jpeg_folder, tmp_path, processes):
    folder = tmp_path / "images"
    for path in jpeg_folder.rglob("*.jpg"):
        (folder / path.parent.name).mkdir(parents=True, exist_ok=True)
        (folder / path.parent.name / path.name).write_bytes(path.read_bytes())
    bad = folder / CLASSES[1] / "3.jpg"
    bad.write_bytes(b"not a jpeg")
    trace = tmp_path / "run.json"
    with AsyncLoader(image_folder(str(folder)), batch_size=4, decode=DECODE, on_error="skip", max_failures=1,
                     trace=str(trace), processes=processes) as loader:
        delivered = sum(len(labels) for _, labels in loader)
    assert delivered == SAMPLES - 1
    failures = [e for e in load(trace) if e["ph"] == "i" and e["name"] == "failure"]
    assert [(f["args"]["sample"], f["args"]["stage"]) for f in failures] == [(str(bad), "decode")]
    assert failures[0]["args"]["error"].startswith("ValueError: not an image")


def test_reads_on_the_event_loop_are_async_spans_with_the_reads_in_flight(s3_jpeg_bucket, s3_options, tmp_path):
    trace = tmp_path / "run.json"
    source = image_folder(s3_jpeg_bucket, storage_options=s3_options)
    with AsyncLoader(source, batch_size=8, decode=DECODE, storage_options=s3_options, trace=str(trace)) as loader:
        assert sum(len(labels) for _, labels in loader) == SAMPLES
    events = load(trace)
    begins = [e for e in events if e["ph"] == "b" and e["name"] == "read"]
    ends = [e for e in events if e["ph"] == "e" and e["name"] == "read"]
    assert len(begins) == len(ends) == SAMPLES
    assert sorted(e["id"] for e in begins) == sorted(e["id"] for e in ends)
    assert all(e["args"]["sample"].startswith(s3_jpeg_bucket) for e in begins)
    in_flight = [e["args"]["reads_in_flight"] for e in events if e["ph"] == "C" and e["name"] == "reads_in_flight"]
    assert len(in_flight) == 2 * SAMPLES and max(in_flight) >= 1 and in_flight[-1] == 0
    assert_nested(events)


def test_the_trace_keeps_the_last_events_and_is_written_at_close(jpeg_folder, tmp_path):
    trace = tmp_path / "run.json"
    loader = AsyncLoader(image_folder(str(jpeg_folder)), batch_size=4, decode=DECODE, trace=str(trace), trace_events=30)
    list(loader)
    epoch_0_ended = max(e[2] for e in loader.stats.tracer.events)
    loader.set_epoch(1)
    list(loader)
    assert not trace.exists(), "written once, at close: building the JSON costs more than recording"
    loader.close()
    kept = [e for e in load(trace) if e["ph"] != "M"]
    assert len(kept) == 30, "a ring of the last trace_events events"
    assert min(e["ts"] for e in kept) > epoch_0_ended * 1e6, "the newest: all from epoch 1"
    assert kept[-1]["name"] in ("hand out", "wait for batch", "batches_ready")


def test_a_loader_never_closed_writes_its_trace_when_collected(jpeg_folder, tmp_path):
    trace = tmp_path / "run.json"
    loader = AsyncLoader(image_folder(str(jpeg_folder)), batch_size=4, decode=DECODE, trace=str(trace))
    list(loader)
    del loader
    gc.collect()
    assert len(spans(load(trace), "decode")) == SAMPLES


def test_without_trace_nothing_is_recorded(jpeg_folder, tmp_path):
    with AsyncLoader(image_folder(str(jpeg_folder)), batch_size=4, decode=DECODE) as loader:
        list(loader)
    assert loader.stats.tracer is None
    with pytest.raises(ValueError, match="trace_events must be at least 1"):
        AsyncLoader(image_folder(str(jpeg_folder)), trace=str(tmp_path / "t.json"), trace_events=0)


def test_keys_are_written_bounded_and_without_their_secrets(tmp_path):
    """The trace is a file people share: a presigned key loses its signature, a 1 MB key its bulk."""
    from asyncload.stats.trace import Tracer

    trace = tmp_path / "run.json"
    tracer = Tracer(str(trace))
    tracer.span("read", 1.0, 2.0, "https://host/b/k.jpg?X-Amz-Date=1&X-Amz-Signature=0ddc0ffee5ecret")
    tracer.async_span("read", 1.0, 2.0, ("k" * 1_000_000, 3))
    tracer.instant("failure", {"sample": "https://user:hunter2@host/k.jpg", "stage": "read", "rank": 1})
    tracer.finish()
    assert trace.stat().st_size < 5_000
    samples = [e["args"]["sample"] for e in load(trace) if "sample" in e.get("args", {})]
    assert samples[0] == "https://host/b/k.jpg?X-Amz-Date=1&X-Amz-Signature=***"
    assert samples[1].startswith("('kkk") and len(samples[1]) == 200
    assert samples[2] == "https://***@host/k.jpg"
