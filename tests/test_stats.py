"""The stats name the bottleneck: each situation is built on purpose."""

import asyncio
import os
import threading
import time

import cv2
import numpy as np
import pytest

from asyncload import AsyncLoader
from asyncload.stats.machine import GilProbe
from asyncload.stats.verdict import diagnose
from tests.conftest import wait_until


def run(read, decode, n=64, consume=None, **kwargs) -> AsyncLoader:
    loader = AsyncLoader(list(range(n)), shuffle=False, read=read, decode=decode, **kwargs)
    with loader:
        for _ in loader:
            if consume:
                consume()
    return loader


def slow_read(seconds):
    async def read(key):
        await asyncio.sleep(seconds)
        return key

    return read


def test_slow_storage_is_named():
    loader = run(slow_read(0.02), np.int64, batch_size=8, io_concurrency=4, prefetch=4)
    name, evidence = diagnose(loader.stats.as_dict())
    assert name == "storage", evidence
    assert "reads in flight averaged" in evidence and "bottleneck: storage" in loader.stats.report()


def test_a_small_prefetch_window_is_named_memory():
    loader = run(slow_read(0.05), np.int64, n=40, batch_size=4, io_concurrency=64, prefetch=1)
    name, evidence = diagnose(loader.stats.as_dict())
    assert name == "memory", evidence
    assert "raise prefetch" in evidence


IMAGE = np.random.default_rng(0).integers(0, 255, (600, 600, 3), dtype=np.uint8)


def native_decode(key):
    """CPU work in OpenCV, which releases the GIL."""
    return cv2.GaussianBlur(IMAGE, (21, 21), 0)[0, 0]


def python_decode(key):
    """CPU work in Python, which holds the GIL."""
    total = 0
    for i in range(40_000):
        total += i * i
    return np.int64(total)


def test_cpu_bound_decode_is_named():
    """Two threads in a native decode (the GIL released) keep both cores busy: decode-bound."""
    f = figures(decodes=1.95, decode_cores=1.9, cores_used=2.0, threads=2, cpu_cores=2)
    f["gil/late_ms"] = 0.2
    assert diagnose(f)[0] == "decode CPU"
    # The same run on a shared box, other processes taking most of a core: still the decode.
    f.update({"decode/cpu_seconds": 1.0, "cpu_seconds": 1.1, "other_processes_cpu_seconds": 0.9, "gil/late_ms": 2.0})
    assert diagnose(f)[0] == "decode CPU"


def test_a_decode_that_holds_the_gil_is_named():
    """Two threads in a Python decode on two cores (figures of a quiet run): together they get one
    core, the other idles, the probe is late: the GIL, the decode named. The verdict needs a core
    the decode threads could have used: with other processes taking it (a shared CI box),
    "decode CPU" is the right answer."""
    f = figures(decodes=1.9, decode_cores=0.95, cores_used=1.1, threads=2, cpu_cores=2)
    f["gil/late_ms"] = 4.0
    name, evidence = diagnose(f)
    assert name == "GIL", evidence
    assert "decode runs Python code that holds it" in evidence and "processes=" in evidence
    f["other_processes_cpu_seconds"] = 0.9
    assert diagnose(f)[0] == "decode CPU"


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="the GIL shows only with two cores or more")
def test_decode_threads_that_hold_the_gil_get_one_core_between_them():
    """End to end, what holds under any load: two threads running Python in decode get at most one
    core between them (a busy machine gives them less, never more), and the verdict in the report
    is the one its figures give. Which verdict depends on what else runs (see the test above)."""
    loader = run(False, python_decode, n=200, batch_size=8, num_threads=2)
    f = loader.stats.as_dict()
    assert (f["decode/items"], f["batches"]) == (200, 25)
    assert 0 < f["decode/cpu_seconds"] <= 1.1 * f["active_seconds"], f
    assert f["bottleneck"] == diagnose(f)[0] and f"bottleneck: {f['bottleneck']}" in loader.stats.report()


def figures(decodes, decode_cores, cores_used, threads=4, cpu_cores=4):
    """One second of a decode-bound run, as ``as_dict()`` gives it."""
    return {
        "active_seconds": 1.0, "batches": 4, "consumer_wait_seconds": 0.9, "decodes_running/mean": decodes,
        "decode/cpu_seconds": decode_cores, "cpu_seconds": cores_used, "other_processes_cpu_seconds": 0.0,
        "cpu_cores": cpu_cores, "num_threads": threads, "reads_in_flight/mean": 0.0, "io_concurrency": 64,
        "batches_ready/mean": 0.0, "prefetch": 2, "producer_waiting/mean": 0.0, "read/seconds": 0.0,
        "decode/seconds": decodes,
    }


def test_the_gil_is_told_by_cpu_the_decode_threads_got():
    """Four threads in decode that get one core between them take turns on the GIL, however many
    threads there are; four that get four cores are decode-bound."""
    assert diagnose(figures(decodes=3.8, decode_cores=1.0, cores_used=1.1))[0] == "GIL"
    assert diagnose(figures(decodes=3.8, decode_cores=3.6, cores_used=3.8))[0] == "decode CPU"
    assert diagnose(figures(decodes=1.0, decode_cores=0.95, cores_used=1.0, threads=1))[0] != "GIL"
    # At the margin: a little over one thread in decode, on a CPU 80 % of that time, is the GIL;
    # on a CPU 92 % of it, it is not.
    assert diagnose(figures(decodes=1.12, decode_cores=0.9, cores_used=1.0))[0] == "GIL"
    assert diagnose(figures(decodes=1.2, decode_cores=1.1, cores_used=1.2))[0] != "GIL"


def test_a_slow_consumer_is_named():
    """The loop waited for data 5 % of the time: the loader is ahead, the step is the limit."""
    f = figures(decodes=0.1, decode_cores=0.1, cores_used=0.2) | {"consumer_wait_seconds": 0.05}
    name, evidence = diagnose(f)
    assert name == "consumer" and "waited for data 5 % of the time" in evidence, evidence


def test_the_time_the_step_takes_is_not_counted_as_waiting():
    """End to end, what holds under any load: while the loop's step runs (a sleep here) the loop
    is not waiting for data, so the wait counted is at most the active time less the steps."""
    slept = []

    def step():
        started = time.perf_counter()
        time.sleep(0.02)
        slept.append(time.perf_counter() - started)

    loader = run(False, np.int64, n=80, batch_size=4, consume=step)
    f = loader.stats.as_dict()
    assert len(slept) == f["batches"] == 20
    assert f["consumer_wait_seconds"] <= f["active_seconds"] - sum(slept), f


def test_figures_add_up():
    loader = run(slow_read(0.001), lambda v: np.full(3, v), n=20, batch_size=6)
    f = loader.stats.as_dict()
    assert (f["read/items"], f["decode/items"], f["write/items"]) == (20, 20, 20)
    assert (f["batches"], f["samples"]) == (4, 20)
    assert f["reads_in_flight/peak"] >= 1 and f["decodes_running/peak"] >= 1
    assert 0 < f["active_seconds"] and f["bottleneck"] in ("storage", "consumer", "mixed", "memory", "decode CPU", "GIL")


def test_interval_callback_gets_plain_figures():
    received = []
    loader = AsyncLoader(list(range(12)), batch_size=3, read=False, decode=np.int64)
    loader.stats.on_interval(0.0, received.append)
    with loader:
        list(loader)
    assert len(received) == 4
    assert received[-1]["samples"] == 12 and isinstance(received[-1]["bottleneck"], str)
    assert all(isinstance(v, (int, float, str)) for v in received[-1].values())


def test_progress_is_quiet_when_not_a_terminal(capsys):
    with AsyncLoader(list(range(20)), batch_size=5, read=False, decode=np.int64, progress=True) as loader:
        list(loader)
    assert capsys.readouterr().err == ""


def test_progress_bar_on_a_terminal(monkeypatch):
    import io
    import sys

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with AsyncLoader(list(range(20)), batch_size=5, read=False, decode=np.int64, progress=True) as loader:
        list(loader)
    shown = terminal.getvalue()
    assert "epoch 0" in shown and "20/20" in shown and "bottleneck: " in shown


def test_the_gil_probe_is_late_while_python_holds_the_gil():
    """A thread spinning in Python holds the GIL for whole switch intervals (5 ms): the probe
    waits for it, on average well past a millisecond. (A busy machine makes it later still, so
    only this side is asserted: how early an idle probe wakes depends on the machine's load.)"""
    stop = threading.Event()
    probe = GilProbe()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    spinner = threading.Thread(target=spin)
    spinner.start()
    probe.start()
    try:
        assert wait_until(lambda: probe.wakeups >= 20, timeout=60), probe.wakeups
    finally:
        probe.stop()
        stop.set()
        spinner.join()
    assert probe.mean_late_ms() > 1.0, probe.mean_late_ms()
    assert not any(t.name == "asyncload-gil-probe" for t in threading.enumerate())


def test_a_busy_gil_with_an_idle_decoder_blames_the_pipeline_not_the_decoder():
    """The GIL-ceiling proxy: 64 threads whose decode sleeps (no GIL, no CPU), the process at one
    core, the probe late: the verdict is the GIL, pointing at processes=, not at the decode."""
    f = figures(decodes=60, decode_cores=0.02, cores_used=1.0, threads=64, cpu_cores=2)
    f["gil/late_ms"] = 1.2
    name, evidence = diagnose(f)
    assert name == "GIL", evidence
    assert "pipeline's own" in evidence and "processes=" in evidence
    assert "decode runs Python" not in evidence
    # The same figures with the GIL free: the threads merely wait on their sleeping decode.
    f["gil/late_ms"] = 0.1
    assert diagnose(f)[0] != "GIL"
    # A late probe in a process that uses a fraction of a core is the OS's scheduling, not the GIL.
    f.update({"gil/late_ms": 2.0, "cpu_seconds": 0.3})
    assert diagnose(f)[0] != "GIL"
