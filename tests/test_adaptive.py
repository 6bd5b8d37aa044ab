"""``processes=None``: the policy (``adapt.py``) from figures alone, and real loaders that switch
to children mid-epoch (``tests/switching.py`` makes the switch happen at a known batch) and
must deliver exactly what ``processes=0`` delivers: order, each sample once, resume across the
switch, skips within their budget, DDP ranks; one line, once, when children cannot be used."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import psutil
import pytest

from asyncload import AsyncLoader, TooManyFailures
from asyncload.adapt import CANCEL_LOOKS, MOST_PREPARES, Policy, Thresholds, gil_bound
from asyncload.procs.choice import blocked_message, children_blocked, children_memory_allows
from tests.decoders import FailsOn, as_array
from tests.switching import children_of, force_switch, set_thresholds, slow_builds

ROOT = Path(__file__).resolve().parent.parent


def sleeps(index):
    """A decode that waits without the GIL, as native code does (2 ms)."""
    time.sleep(0.002)
    return np.full(2, index, np.int64)


def loader_for(n, processes=None, **kwargs):
    kwargs = {"batch_size": 4, "read": False, "decode": as_array, "num_threads": 2, **kwargs}
    return AsyncLoader(list(range(n)), processes=processes, **kwargs)


def batches(loader):
    return [batch[:, 0].tolist() for batch in loader]


# ----- the policy, from figures -----


def window(rate=100.0, **figures):
    """One look's figures, as ``LoaderStats.as_dict()`` gives them: by default a loop that waits."""
    base = {"active_seconds": 1.0, "batches": 10, "samples": rate, "consumer_wait_seconds": 0.5,
            "decodes_running/mean": 1.0, "num_threads": 4, "reads_in_flight/mean": 0.0, "io_concurrency": 64,
            "cpu_seconds": 1.0, "other_processes_cpu_seconds": 0.0, "cpu_cores": 4, "decode/cpu_seconds": 0.9,
            "gil/late_ms": 0.1, "batches_ready/mean": 0.2, "prefetch": 2, "producer_waiting/mean": 0.0,
            "read/seconds": 0.0, "decode/seconds": 1.0}
    return {**base, **figures}


GIL = window(**{"gil/late_ms": 3.0})  # a core busy, three idle, a probe that waits for the GIL
NATIVE = window(**{"decodes_running/mean": 3.9, "decode/cpu_seconds": 3.8, "cpu_seconds": 3.9})  # every core decoding


def judge_of(*verdicts):
    answers = iter(verdicts)
    return lambda figures: (next(answers), "GIL: a test's")


def policy(*verdicts, memory=64, **thresholds):
    return Policy(16, lambda: memory, Thresholds(**{"looks": 2, **thresholds}), judge=judge_of(*verdicts))


def test_the_verdict_says_gil_for_python_under_one_gil_and_not_for_native_decode():
    assert gil_bound(GIL)[0] and gil_bound(GIL)[1].startswith("GIL: ")
    assert not gil_bound(NATIVE)[0]
    assert not gil_bound(window(consumer_wait_seconds=0.01, **{"gil/late_ms": 3.0}))[0]  # the loop did not wait


# Native JPEG decode on 16 cores in one process (measured on an H200 box): 15 of 16 threads in
# decode got 5.7 cores between them, 10 idle, the probe 0.3-0.6 ms late.
QUEUED = window(**{"cpu_cores": 16, "num_threads": 16, "decodes_running/mean": 15.2, "decode/cpu_seconds": 5.3,
                   "cpu_seconds": 5.7, "gil/late_ms": 0.3})


def test_native_decode_whose_threads_queue_for_the_gil_on_many_cores_is_gil_bound():
    assert gil_bound(QUEUED)[0] and "on a CPU only 35 % of their time in decode" in gil_bound(QUEUED)[1]
    assert not gil_bound({**QUEUED, "gil/late_ms": 0.1})[0]  # off the CPU with the GIL free: I/O or a GPU
    assert not gil_bound({**QUEUED, "decode/cpu_seconds": 13.0, "cpu_seconds": 13.5})[0]  # the cores decode
    two_cores = {**QUEUED, "cpu_cores": 2, "num_threads": 2, "decodes_running/mean": 1.9,
                 "decode/cpu_seconds": 1.8, "cpu_seconds": 1.9}
    assert not gil_bound(two_cores)[0]


def test_the_switch_waits_for_looks_in_a_row_that_say_gil():
    chooser = policy(True, False, True, True)
    assert chooser.look(GIL).kind == "prepare"  # one GIL look: children start, in case
    assert chooser.look(GIL) is None  # then a look that says otherwise: the streak starts again
    assert (chooser.look(GIL), chooser.state) == (None, "measuring")  # the children started are kept
    step = chooser.look(GIL)
    assert (step.kind, step.count) == ("start", 4)  # 16 cores: a quarter to begin with
    assert chooser.look(GIL) is None  # starting: no more decisions until the switch


def test_children_started_ahead_are_stopped_after_calm_looks_and_rationed():
    chooser = policy(*([True] + [False] * CANCEL_LOOKS) * (MOST_PREPARES + 1))
    kinds = [getattr(chooser.look(GIL), "kind", None) for _ in range((CANCEL_LOOKS + 1) * (MOST_PREPARES + 1))]
    assert kinds.count("prepare") == MOST_PREPARES and kinds.count("cancel") == MOST_PREPARES
    assert kinds[CANCEL_LOOKS] == "cancel" and chooser.state == "measuring"


def test_a_native_decoder_never_starts_children():
    chooser = Policy(16, lambda: 64, Thresholds(looks=1))
    assert all(chooser.look(NATIVE) is None for _ in range(20))
    assert chooser.state == "measuring" and chooser.count == 0


def test_after_a_switch_the_policy_grows_while_it_helps_then_settles_for_good():
    chooser = policy(True, True, first=2, looks=1)
    assert chooser.look(window(100)).count == 2
    chooser.switched(2)
    assert chooser.look(window(50)) is None  # the ramp after the switch is not judged
    step = chooser.look(window(190))  # 1.9x in-process
    assert (step.kind, step.count) == ("start", 4)
    chooser.switched(4)
    chooser.look(window(10))
    step = chooser.look(window(200))  # 1.05x two children: not worth more
    assert (step.kind, step.count) == ("settle", 4) and "1.05x 2's" in step.why
    assert all(chooser.look(window(rate)) is None for rate in (1, 1000, 1, 1000))  # settled: no flapping


def test_a_first_step_that_did_not_help_goes_back_in_process():
    chooser = policy(True, looks=1)
    chooser.look(window(100))
    chooser.switched(4)
    chooser.look(window(100))
    step = chooser.look(window(80))
    assert (step.kind, step.count) == ("back", 0) and chooser.state == "settled"


def test_memory_caps_the_children():
    assert policy(True, memory=3, looks=1).look(window()).count == 3  # 4 wanted, 3 fit
    step = policy(True, memory=1, looks=1).look(window())
    assert step.kind == "settle" and "memory has room for 1 child processes only" in step.why
    gib = 2**30
    assert children_memory_allows(gib // 2, available=6 * gib, total=10 * gib) == 10  # 1 GiB kept back
    assert children_memory_allows(gib // 2, available=gib, total=10 * gib) == 0


def test_what_blocks_children_is_named_in_one_line():
    assert children_blocked({"source": [1, 2], "decode": as_array}) is None
    reason = children_blocked({"source": [1, 2], "decode": lambda item: item})
    assert reason.startswith("decode=<function test_what_blocks_children") and "does not pickle" in reason
    line = blocked_message(reason, 2)
    assert "\n" not in line and "processes=0" in line and "top level of a module" in line


# ----- real loaders that switch -----


def test_a_gil_bound_decoder_switches_and_delivers_the_exact_epoch(monkeypatch):
    with loader_for(60, processes=0, seed=5) as pinned:
        expected = [batches(pinned), batches(pinned)]
    force_switch(monkeypatch)
    with loader_for(60, seed=5) as loader:
        assert children_of(loader) == 0
        first = batches(loader)
        assert children_of(loader) == 2  # switched after the second batch, at a batch boundary
        assert [first, batches(loader)] == expected  # the next pass runs on the children
        assert "processes=None: 2 child processes: GIL: forced by the test" in loader.stats.report()
        assert sorted(sum(first, [])) == list(range(60))


def test_children_that_did_not_help_give_way_to_a_fresh_in_process_backend(monkeypatch):
    """Going back builds a new in-process backend (its own ring and stats, the figures carried):
    the epoch stays exact, the children's backend is closed, and the loader stays there."""
    with loader_for(80, processes=0, seed=3) as pinned:
        expected = [batches(pinned), batches(pinned)]
    force_switch(monkeypatch)
    set_thresholds(monkeypatch, keep=float("inf"))  # any rate is below in-process's
    with loader_for(80, seed=3) as loader:
        first, seen, got, children = loader._backend, [], [], []
        for batch in loader:
            got.append(batch[:, 0].tolist())
            seen.append(children_of(loader))
            if seen[-1]:
                children = [child.pid for child in loader._backend.pipelines.processes]
        assert got == expected[0] and seen[0] == 0 and 2 in seen and seen[-1] == 0
        assert children and not any(psutil.pid_exists(pid) for pid in children)  # closed once its run stopped
        assert loader._backend is not first  # a fresh one, not the first one used again
        assert loader.stats.samples == 80 and "back in this process" in loader.stats.report()
        assert batches(loader) == expected[1] and children_of(loader) == 0


@pytest.mark.parametrize("cut", [1, 5])  # a state taken before the switch, and one after it
def test_a_resume_across_the_switch_delivers_the_rest_as_the_uninterrupted_run(monkeypatch, cut):
    with loader_for(40, processes=0, seed=2) as pinned:
        expected = batches(pinned)
    force_switch(monkeypatch)
    with loader_for(40, seed=2) as loader:
        got = []
        for batch in loader:
            got.append(batch[:, 0].tolist())
            if len(got) == cut:
                state = loader.state_dict()
                break
        assert children_of(loader) == (2 if cut > 2 else 0)  # the switch comes after the second batch
    assert got == expected[:cut]
    # Resumed where the switch has yet to come, the loader switches after its own second batch.
    with loader_for(40, seed=2, processes=None if cut <= 2 else 0) as resumed:
        resumed.load_state_dict(state)
        rest = batches(resumed)
        assert children_of(resumed) == (2 if cut <= 2 else 0)
    assert got + rest == expected


def test_skips_across_the_switch_keep_their_budget(monkeypatch):
    """Which position replaces a skipped row depends on when its failure is answered, in any
    mode; what may not differ: every sample once but the failed, each failure counted once,
    the budget spanning the switch."""
    options = dict(seed=4, on_error="skip", decode=FailsOn({3, 17, 30}), max_failures=3)
    force_switch(monkeypatch)
    with loader_for(40, **options) as loader:
        got = batches(loader)
        assert children_of(loader) == 2
        assert sorted(sum(got, [])) == sorted(set(range(40)) - {3, 17, 30})
        assert sorted(f.item for f in loader.stats.failures) == [3, 17, 30]  # each once
        assert got[:2] == loader_batches_before_any_failure(options)
    with loader_for(40, **{**options, "max_failures": 2}) as over:
        with pytest.raises(TooManyFailures):
            batches(over)


def loader_batches_before_any_failure(options):
    with loader_for(40, processes=0, **options) as pinned:
        return batches(pinned)[:2]


@pytest.mark.parametrize("rank", [0, 1])
def test_ddp_ranks_across_the_switch(monkeypatch, rank):
    with loader_for(30, processes=0, seed=6, rank=rank, world_size=2) as pinned:
        expected = batches(pinned)
    force_switch(monkeypatch)
    with loader_for(30, seed=6, rank=rank, world_size=2) as loader:
        assert batches(loader) == expected and len(expected) == len(loader)
        assert children_of(loader) == 2


def test_an_unpicklable_decoder_stays_in_process_and_says_so_once(monkeypatch):
    force_switch(monkeypatch)

    def local_decode(index):  # a nested function: a spawned process cannot find it
        return np.full(2, index, np.int64)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with loader_for(24, seed=1, decode=local_decode) as loader:
            got = [batches(loader), batches(loader)]
            assert children_of(loader) == 0
    with loader_for(24, processes=0, seed=1) as pinned:
        assert got == [batches(pinned), batches(pinned)]
    said = [str(w.message) for w in caught if "processes=None" in str(w.message)]
    assert len(said) == 1 and "\n" not in said[0]
    assert "decode=<function test_an_unpicklable_decoder" in said[0] and "does not pickle" in said[0]
    assert "child processes cannot be used" in loader.stats.report()


def test_a_decoder_that_waits_without_the_gil_does_not_switch(monkeypatch):
    force_switch(monkeypatch)
    monkeypatch.setattr("asyncload.adapt.gil_bound", gil_bound)  # the real verdict, at every batch
    with loader_for(120, seed=0, decode=sleeps, batch_size=8) as loader:
        assert sorted(sum(batches(loader), [])) == list(range(120))
        assert children_of(loader) == 0 and loader._switch.policy.count == 0


def test_no_thread_or_child_left_after_break_and_close(monkeypatch, tmp_path):
    force_switch(monkeypatch)
    trace = tmp_path / "trace.json"
    loader = loader_for(80, seed=3, trace=trace)
    for number, _ in enumerate(loader):
        if number == 6:
            break
    pids = [process.pid for process in loader._backend.pipelines.processes]
    assert len(pids) == 2
    loader.close()
    assert all(not psutil.pid_exists(pid) for pid in pids)
    names = {event.get("name") for event in json.loads(trace.read_text())["traceEvents"]}
    assert "processes: switch to 2 child processes" in names


def test_a_script_without_the_main_guard_moves_to_children_that_never_import_it(tmp_path):
    """Its decode comes from a module: the children need nothing of the script, so they do not
    import it, and the default moves as in any script (``tests/test_script.py`` has the rest)."""
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        import pytest
        from tests.switching import force_switch
        from tests.decoders import as_array
        from asyncload import AsyncLoader
        patch = pytest.MonkeyPatch()
        force_switch(patch)
        with AsyncLoader(list(range(40)), batch_size=4, read=False, decode=as_array, seed=0) as loader:
            got = sorted(int(i) for batch in loader for i in batch[:, 0])
        print("delivered", got == list(range(40)), loader._backend.processes)
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert "delivered True 2" in done.stdout, done.stderr
    assert done.stdout.count("delivered") == 1, "the script ran once"
    assert "processes=None" not in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_looks_while_children_start_are_not_judged(monkeypatch):
    """Children starting take the cores the verdict counts as idle, so a look then would see
    "not the GIL" and stop them: only looks once they are ready count (the second GIL look in a
    row switches). The judge here says GIL only when no children are starting; the children's
    build ends once a look came while they started."""
    import threading

    import asyncload.adapt as adapt
    import asyncload.switch as switch

    set_thresholds(monkeypatch, look_s=0.0, looks=2, first=2, most=2, keep=0.0)
    loader_box, judged_while_starting, looks_while_starting = [], [], []

    def judge(window):
        starting = loader_box[0]._switch.starting is not None
        judged_while_starting.append(starting)
        return (not starting, "GIL: a test's" if not starting else "decode CPU: the children's start")

    monkeypatch.setattr(adapt, "gil_bound", judge)
    real_look = switch.Switch._look

    seen_while_starting = threading.Event()

    def look(self, now):
        looks_while_starting.append(self.starting is not None)
        if self.starting is not None:
            seen_while_starting.set()
        real_look(self, now)

    monkeypatch.setattr(switch.Switch, "_look", look)
    slow_builds(monkeypatch, until=seen_while_starting)
    with loader_for(100_000, decode=as_array_slowly, seed=1) as loader:
        loader_box.append(loader)
        for _ in loader:  # until it switched (the epoch bounds it)
            if children_of(loader) == 2:
                break
        assert children_of(loader) == 2, loader.stats.report()
        assert any(looks_while_starting), "looks came while the children started"
        assert not any(judged_while_starting), "none of them was judged"


def as_array_slowly(index):
    time.sleep(0.001)
    return as_array(index)


def test_close_while_children_start_leaves_no_child_or_thread(monkeypatch):
    """Children are built on a thread; ``close()`` during their start waits for it and closes
    them: nothing outlives the loader."""
    import threading

    import asyncload.adapt as adapt

    set_thresholds(monkeypatch, look_s=0.0, looks=2, first=2, most=2)
    monkeypatch.setattr(adapt, "gil_bound", lambda window: (True, "GIL: forced by the test"))
    pids: list[int] = []
    slow_builds(monkeypatch, pids)
    loader = loader_for(100_000, decode=as_array_slowly, seed=2)
    batches_seen = iter(loader)
    while loader._switch.starting is None:
        next(batches_seen)
    loader.close()
    assert len(pids) == 2 and all(not psutil.pid_exists(pid) for pid in pids), "the children built are closed"
    assert not [thread for thread in threading.enumerate() if thread.name == "asyncload-start"]
