"""num_threads="auto" / io_concurrency="auto": the tuner's rules, and the loader under it."""

import asyncio
import math
import threading

import numpy as np

from asyncload import AsyncLoader
from asyncload.autotune import AutoTuner, Knob, interval_figures
from asyncload.gates import Gate
from asyncload.stats.loader_stats import LoaderStats
from asyncload.stats.machine import usable_cores
from tests.stat_figures import Stats
from tests.stat_figures import window as running_window


def test_gate_limits_threads_and_follows_a_new_limit():
    """Threads inside the gate wait for one another at a barrier of ``limit``: each round lets
    exactly ``limit`` in at once (no sleep: the barrier is the event), never more."""
    gate, inside, peak, lock = Gate(2), [0], [0], threading.Lock()

    def run(threads: int, limit: int) -> None:
        barrier = threading.Barrier(limit, timeout=30)  # broken (an error) if the gate let fewer in

        def work():
            with gate:
                with lock:
                    inside[0] += 1
                    peak[0] = max(peak[0], inside[0])
                barrier.wait()
                with lock:
                    inside[0] -= 1

        workers = [threading.Thread(target=work) for _ in range(threads)]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        assert not barrier.broken

    run(6, 2)
    assert peak[0] == 2
    gate.set_limit(4)
    peak[0] = 0
    run(8, 4)
    assert peak[0] == 4


def window(waited, decodes=0.5, reads=1.0, threads=2, io=16, read_s=0.1, decode_s=1.0):
    """Figures for one look of the tuner (one second of running)."""
    return {
        "active_seconds": 1.0, "batches": 10, "consumer_wait_seconds": waited, "decodes_running/mean": decodes,
        "reads_in_flight/mean": reads, "batches_ready/mean": 0.5, "producer_waiting/mean": 0.0,
        "num_threads": threads, "io_concurrency": io, "prefetch": 2, "cpu_seconds": decodes, "cpu_cores": 8,
        "other_processes_cpu_seconds": 0.0, "read/seconds": read_s, "decode/seconds": decode_s,
        "decode/cpu_seconds": decodes,
    }


def tuner():
    threads = Knob("num_threads", 2, 1, 8)
    io = Knob("io_concurrency", 16, 1, 1024)
    return AutoTuner(LoaderStats(16, 2, 2), threads, io), threads, io


def test_storage_bound_waiting_doubles_reads_in_flight():
    t, threads, io = tuner()
    t._decide(window(0.5, decodes=0.2, reads=15.5, io=16))
    assert (io.value, threads.value, io.floor) == (32, 2, 17)
    assert t.changes[-1][1:4] == ("io_concurrency", 16, 32) and "storage" in t.changes[-1][4]


def test_decode_bound_waiting_adds_a_thread():
    t, threads, io = tuner()
    t._decide(window(0.5, decodes=1.9, threads=2))
    assert (threads.value, io.value) == (3, 16)


def test_no_raise_where_it_cannot_help():
    t, threads, io = tuner()
    busy_cores = window(0.5, decodes=1.9, threads=2)
    busy_cores["cpu_seconds"] = 7.8  # of 8 cores: a third thread would have no core to run on
    t._decide(busy_cores)
    slow_reads_below_cap = window(0.5, decodes=0.2, reads=4.0, io=16, read_s=5.0, decode_s=0.2)
    t._decide(slow_reads_below_cap)  # "storage", yet 4 reads of 16 allowed: the cap is not the limit
    assert (threads.value, io.value, t.changes) == (2, 16, [])


def test_calm_looks_lower_an_idle_knob_but_never_below_its_floor():
    t, threads, io = tuner()
    threads.set(4)
    threads.floor = 3
    for _ in range(3):
        t._decide(window(0.0, decodes=1.0, threads=4))
    assert threads.value == 3
    for _ in range(6):
        t._decide(window(0.0, decodes=1.0, threads=3))
    assert threads.value == 3, "the floor holds: fewer threads once made the loop wait"


def test_no_oscillation_between_two_settings():
    t, threads, _ = tuner()
    values = []
    for _ in range(30):  # the loop waits whenever fewer than 3 threads work
        waited = 0.5 if threads.value < 3 else 0.0
        t._decide(window(waited, decodes=min(threads.value, 2.5), threads=threads.value))
        values.append(threads.value)
    assert values[-10:] == [3] * 10
    assert [change[1:4] for change in t.changes if change[1] == "num_threads"] == [("num_threads", 2, 3)]


def test_interval_figures_are_differences():
    before = {"active_seconds": 2.0, "reads_in_flight/mean": 4.0, "batches": 5, "read/seconds": 1.0}
    after = {"active_seconds": 3.0, "reads_in_flight/mean": 6.0, "batches": 9, "read/seconds": 4.0}
    w = interval_figures(before, after)
    assert (w["active_seconds"], w["batches"], w["read/seconds"]) == (1.0, 4, 3.0)
    assert w["reads_in_flight/mean"] == 10.0  # (6*3 - 4*2) / 1


def test_auto_io_raised_by_the_tuner_reaches_the_running_pipeline_and_delivers_everything():
    """The tuner's raise (from numbers: ``test_adapt_logic.py``) reaches the pipeline while the
    epoch runs: reads in flight double at each look that says storage made the loop wait. The
    looks are the test's, at the times it says, not the clock's."""
    async def read(key):
        await asyncio.sleep(0)
        return key

    loader = AsyncLoader(list(range(400)), batch_size=4, read=read, decode=np.int64, io_concurrency="auto")
    loader.tuner.interval = math.inf  # no look of its own
    start = loader.stats.limits["io_concurrency"]
    stats = Stats()
    storage = running_window(waited=0.6, **{"gil/late_ms": 0.1, "decodes_running/mean": 0.2, "decode/cpu_seconds": 0.2,
                                    "cpu_seconds": 0.3, "reads_in_flight/mean": start, "io_concurrency": start})
    got = []
    with loader:
        for now, batch in enumerate(loader):
            if now < 3:
                loader.tuner.look(stats.run(storage), float(now))  # a baseline, then two raises
            got.extend(batch.tolist())
        assert loader._backend.pipelines.io_concurrency == 4 * start
    assert sorted(got) == list(range(400))
    assert loader.stats.limits["io_concurrency"] == 4 * start
    assert [(old, new) for _, _, old, new, _ in loader.tuner.changes] == [(start, 2 * start), (2 * start, 4 * start)]


def test_auto_threads_lowered_by_the_tuner_reach_the_running_pipeline():
    """Calm looks (the loop never waited, a decode thread idle) lower the threads one step per
    three looks, from however many this machine starts with down to 1, while the epoch runs and
    delivers every sample. The looks are the test's, at the times it says: one a batch, so the
    epoch has a baseline's and three looks a step's batches for this machine's cores, at least 100."""
    items = 4 * max(100, 3 * usable_cores() + 2)
    loader = AsyncLoader(list(range(items)), batch_size=4, read=False, decode=np.int64, num_threads="auto")
    loader.tuner.interval = math.inf  # no look of its own
    start = loader.stats.limits["num_threads"]
    stats = Stats()
    got = []
    with loader:
        for now, batch in enumerate(loader):
            threads = loader.stats.limits["num_threads"]
            calm = running_window(waited=0.0, **{"decodes_running/mean": 0.0, "num_threads": threads})
            loader.tuner.look(stats.run(calm), float(now))
            got.extend(batch.tolist())
    assert sorted(got) == list(range(items))
    assert loader.stats.limits["num_threads"] == 1
    steps = [(old, new) for _, name, old, new, _ in loader.tuner.changes if name == "num_threads"]
    assert steps == [(n, n - 1) for n in range(start, 1, -1)]
