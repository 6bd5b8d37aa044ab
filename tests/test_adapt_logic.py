"""The adaptive policies as logic, fed the stats' running figures at given times (numbers, no
clock, no thread, no loader): when a look is due and what window it sees (``autotune.Looks``),
the tuner's knob moves (``autotune.AutoTuner.look``), and ``processes=None``'s decisions
(``adapt.Policy`` behind the switch's looks: a GIL verdict -> children; samples/s rising -> more;
falling -> stay, or back in this process)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from asyncload.adapt import Policy, Thresholds, gil_bound
from asyncload.autotune import AutoTuner, Knob, Looks, interval_figures
from asyncload.switch import Switch
from tests.stat_figures import Stats, window
from tests.switching import set_thresholds

# ----- looks -----


def test_a_look_is_due_an_interval_after_the_last_and_sees_the_figures_since():
    looks = Looks(1.0, now=100.0)
    assert not looks.due(100.5) and looks.due(101.0)
    stats = Stats()
    assert looks.take(stats.run(window(rate=100)), 101.0) is None, "the first look sets the baseline"
    assert not looks.due(101.9) and looks.due(102.0)
    seen = looks.take(stats.run(window(rate=300, waited=0.25)), 102.0)
    assert (seen["samples"], seen["consumer_wait_seconds"], seen["active_seconds"]) == (300, 0.25, 1.0)


def test_the_switchs_first_look_comes_at_once_and_a_switch_starts_a_new_baseline():
    looks = Looks(0.3, now=0.0, at_once=True)
    assert looks.due(0.0)
    in_process = Stats()
    looks.take(in_process.run(window()), 0.0)
    assert not looks.due(0.2) and looks.due(0.3)
    children = Stats(processes=2)  # the stats of a new backend: no window against the old one's
    assert looks.take(children.run(window()), 0.3) is None
    assert looks.take(children.run(window(rate=50)), 0.6)["samples"] == 50
    looks.forget()
    assert looks.due(0.61), "after forget(), at once again"


def test_interval_figures_recompute_means_from_their_time_integrals():
    stats = Stats()
    before = stats.run(window(**{"reads_in_flight/mean": 4.0}))
    after = stats.run(window(**{"reads_in_flight/mean": 10.0}))
    assert interval_figures(before, after)["reads_in_flight/mean"] == 10.0


# ----- the tuner -----


class Fed:
    """What the tuner reads: the stats' running figures (``as_dict``) and the clock (``now``),
    both set by the test."""

    def __init__(self, now: float) -> None:
        self.figures: dict[str, Any] = {}
        self.now = now
        self.limits: dict[str, int] = {}

    def as_dict(self) -> dict[str, Any]:
        return self.figures


def tuner(now: float = 0.0) -> tuple[AutoTuner, Knob, Knob]:
    threads, io = Knob("num_threads", 2, 1, 8), Knob("io_concurrency", 16, 1, 1024)
    fed = Fed(now)
    return AutoTuner(fed, threads, io, interval=1.0, clock=lambda: fed.now), threads, io  # type: ignore[arg-type]


def observe(t: AutoTuner, stats: Stats, figures: dict[str, Any], now: float) -> None:
    """A batch handed out at ``now`` (seconds) after ``figures``' window of running: the real
    ``AutoTuner.observe``, its stats and clock the test's."""
    t.stats.figures, t.stats.now = stats.run(figures), now  # type: ignore[attr-defined]
    t.observe()


def test_the_tuner_doubles_reads_in_flight_when_storage_is_the_wait_once_per_interval():
    t, threads, io = tuner()
    stats = Stats()
    storage = window(waited=0.6, **{"gil/late_ms": 0.1, "decodes_running/mean": 0.2, "decode/cpu_seconds": 0.2,
                                    "cpu_seconds": 0.3, "reads_in_flight/mean": 15.5, "io_concurrency": 16})
    observe(t, stats, storage, 1.0)  # the baseline
    observe(t, stats, storage, 1.5)  # not due
    assert t.changes == []
    observe(t, stats, storage, 2.0)
    assert [(when, name, old, new) for when, name, old, new, _ in t.changes] == [(2.0, "io_concurrency", 16, 32)]
    assert "storage" in t.changes[0][4] and (io.floor, threads.value) == (17, 2)


def test_the_tuner_adds_a_decode_thread_when_decode_is_the_wait_and_a_core_is_idle():
    t, threads, _ = tuner()
    stats = Stats()
    decode = window(waited=0.6, **{"gil/late_ms": 0.1, "decodes_running/mean": 1.9, "decode/cpu_seconds": 1.9,
                                   "cpu_seconds": 2.0, "num_threads": 2, "cpu_cores": 8})
    for now in (1.0, 2.0, 3.0):
        observe(t, stats, decode, now)
    assert [(name, old, new) for _, name, old, new, _ in t.changes] == [("num_threads", 2, 3), ("num_threads", 3, 4)]


def test_the_tuner_lowers_an_idle_knob_after_three_calm_looks():
    t, threads, _ = tuner()
    threads.set(4)
    stats = Stats()
    calm = window(waited=0.0, **{"decodes_running/mean": 1.0, "num_threads": 4})
    for now in (1.0, 2.0, 3.0):
        observe(t, stats, calm, now)
    assert threads.value == 4, "two calm looks are not enough"
    observe(t, stats, calm, 4.0)
    assert threads.value == 3 and t.changes[-1][0] == 4.0


def test_the_tuner_does_not_count_a_look_with_no_batch_as_calm():
    t, threads, _ = tuner()
    threads.set(4)
    stats = Stats()
    idle = window(waited=0.0, batches=0, **{"decodes_running/mean": 1.0, "num_threads": 4})
    for now in (1.0, 2.0, 3.0, 4.0, 5.0):
        observe(t, stats, idle, now)
    assert (threads.value, t.changes) == (4, []), "no batch: nothing to judge"


class SwitchStats(Fed):
    """A backend's stats as the switch reads them: running figures, the clock, the choice's line."""

    processes_choice: str | None = None
    tracer = None

    def carry(self, earlier: Any) -> None:
        pass


def test_the_switchs_looks_at_once_every_look_s_not_judged_while_children_start_and_anew_after_a_switch(
        monkeypatch):
    """The real ``Switch.due``, its clock and stats the test's, its policy a recorder: the first
    look sets the baseline at once; then one every ``look_s``; a look while children start is
    taken (the next window starts there) but not judged; after a switch, the new backend's first
    look comes at once and only sets its baseline."""
    set_thresholds(monkeypatch, look_s=0.3)
    fed, stats, judged = SwitchStats(0.0), Stats(), []
    chosen = Switch(None, SimpleNamespace(stats=fed, processes=0), use=lambda backend: None,  # type: ignore[arg-type]
                    clock=lambda: fed.now)
    chosen.policy = SimpleNamespace(state="measuring", look=lambda seen: judged.append(seen["samples"]),  # type: ignore[assignment]
                                    switched=lambda count: None, count=2)

    def batch(now: float, rate: float) -> None:  # a batch handed out at ``now`` after ``rate`` samples of running
        fed.figures, fed.now = stats.run(window(rate=rate)), now
        assert not chosen.due()

    batch(0.0, 10)
    batch(0.1, 20)
    assert judged == [], "the first look (at once) is the baseline; the next is look_s after it"
    batch(0.3, 30)
    assert judged == [50]
    chosen.starting = SimpleNamespace(count=2, thread=SimpleNamespace(join=lambda wait: None, is_alive=lambda: True))  # type: ignore[assignment]
    batch(0.6, 40)
    assert judged == [50], "children starting: not judged"
    chosen.starting = None
    batch(0.9, 50)
    assert judged == [50, 50], "the window since the look while they started"
    chosen.target = SimpleNamespace(stats=SwitchStats(0.9), processes=2)  # type: ignore[assignment]
    chosen.take()
    fed, stats = chosen.backend.stats, Stats(processes=2)
    batch(1.0, 60)
    batch(1.2, 70)
    assert judged == [50, 50], "after a switch the first look (at once) is the new backend's baseline"
    batch(1.3, 80)
    assert judged == [50, 50, 150]


# ----- processes=None's decisions -----


def policy(memory: int = 64, **thresholds: Any) -> Policy:
    return Policy(16, lambda: memory, Thresholds(**{"looks": 2, "first": 2, **thresholds}))


def looking(chooser: Policy, windows: list[dict[str, Any]], start: float = 0.0, processes: int | None = None) -> list:
    """The switch's looks (``Switch.due``: at once, then every ``look_s``) over one window of
    running each, at 0.3 s apart; the steps the policy took, None where it took none."""
    looks, stats, steps = Looks(0.3, now=start, at_once=True), Stats(processes), []
    looks.take(stats.run(window()), start)
    for number, figures in enumerate(windows, 1):
        seen = looks.take(stats.run(figures), start + 0.3 * number)
        step = chooser.look(seen) if seen is not None else None
        steps.append(None if step is None else (step.kind, step.count))
    return steps


def test_gil_verdicts_in_a_row_move_to_children():
    assert gil_bound(window())[0]
    chooser = policy()
    assert looking(chooser, [window(), window()]) == [("prepare", 2), ("start", 2)]
    assert chooser.state == "starting" and chooser.rates[0] == 100


def test_a_loop_that_does_not_wait_or_native_decode_never_moves():
    native = window(**{"gil/late_ms": 0.1, "decodes_running/mean": 3.9, "decode/cpu_seconds": 3.8, "cpu_seconds": 3.9})
    assert not gil_bound(native)[0]
    chooser = policy()
    assert looking(chooser, [window(waited=0.02)] * 3 + [native] * 3) == [None] * 6
    assert chooser.state == "measuring"


def test_samples_per_second_rising_adds_children_and_falling_stays():
    chooser = policy(looks=1)
    assert looking(chooser, [window(rate=100)]) == [("start", 2)]
    chooser.switched(2)
    # the ramp after the switch is not judged; then 1.8x in-process: twice the children
    assert looking(chooser, [window(rate=20), window(rate=180)], processes=2) == [None, ("start", 4)]
    chooser.switched(4)
    # 4 children gave less than 2 did: it settles on 4 for good (never back and forth)
    assert looking(chooser, [window(rate=50), window(rate=150)], processes=4) == [None, ("settle", 4)]
    assert looking(chooser, [window(rate=1000), window(rate=1)], processes=4) == [None, None]


def test_a_first_step_that_did_not_help_goes_back_in_process():
    chooser = policy(looks=1)
    looking(chooser, [window(rate=100)])
    chooser.switched(2)
    assert looking(chooser, [window(rate=100), window(rate=90)], processes=2) == [None, ("back", 0)]
    assert chooser.state == "settled"


def test_children_are_not_added_while_the_loop_does_not_wait():
    chooser = policy(looks=1)
    looking(chooser, [window(rate=100)])
    chooser.switched(2)
    steps = looking(chooser, [window(rate=100), window(rate=300, waited=0.01)], processes=2)
    assert steps == [None, ("settle", 2)]


def test_the_tuner_keeps_reads_in_flight_within_the_memory_budget_of_the_figures_it_sees():
    """The cap comes from the figures of the look (mean object size so far), not from the
    live stats: 1 GiB over 10 MiB objects is 102 reads, not the 128 a doubling would give."""
    t, threads, io = tuner()
    io.set(64)
    stats = Stats()
    storage = window(waited=0.6, **{"gil/late_ms": 0.1, "decodes_running/mean": 0.2, "decode/cpu_seconds": 0.2,
                                    "cpu_seconds": 0.3, "reads_in_flight/mean": 63.5, "io_concurrency": 64,
                                    "read/items": 100, "read/bytes": 100 * 10 * 2**20})
    observe(t, stats, storage, 1.0)
    observe(t, stats, storage, 2.0)
    assert [(old, new) for _, _, old, new, _ in t.changes] == [(64, 102)]
