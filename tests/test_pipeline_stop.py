"""A run stopped before its pipeline has taken its ``Start``: the driver's ``Start``, ``Fill``
and ``Stop`` all reach ``Pipeline.handle`` while the event loop is busy elsewhere (a child's
control thread reads them off the pipe in one burst when a Ctrl-C or a ``break`` comes at the
run's first wait). The stop's mark then finds no run to mark, the fill starts a read task, and
the stop cancels that task before its first step; such a task never enters its body (not its
``finally`` either), so its row never ended, the run's ``Stopped`` never went out and the read
slot stayed taken: the driver waited for ever (test_procs' Ctrl-C test hung about one run in
twenty on a loaded box). Driven here message by message, with the loop held while they arrive."""

from __future__ import annotations

import threading
from collections import Counter

import numpy as np

from asyncload import AsyncLoader
from asyncload.batch.buffers import BatchBuffer
from asyncload.batch.layout import SampleLayout
from asyncload.pipeline.messages import Done, Fill, Start, Stop, Stopped
from asyncload.pipeline.pipeline import Pipeline
from asyncload.stats.loader_stats import LoaderStats

ANSWER_WAIT_S = 60.0  # only a guard against a hang: each answer comes in milliseconds


def read_index(index: int) -> bytes:
    """The item's bytes: its index (``read=`` with a callable makes every read a read task)."""
    return np.array([index], np.int64).tobytes()


def decode_row(data: bytes) -> np.ndarray:
    return np.frombuffer(data, np.int64).copy()


class Answers:
    """What the pipeline sends, and an event per awaited kind of answer."""

    def __init__(self) -> None:
        self.got: list = []
        self.stopped = threading.Event()
        self.done = threading.Event()

    def send(self, message) -> None:
        self.got.append(message)
        if isinstance(message, Stopped):
            self.stopped.set()
        elif isinstance(message, Done):
            self.done.set()


def new_pipeline() -> tuple[Pipeline, BatchBuffer, Answers]:
    """A pipeline of one 4-row buffer (slot 0) whose every read is a read task, one at a time,
    and what it answers."""
    with AsyncLoader(list(range(8)), batch_size=4, read=read_index, decode=decode_row, io_concurrency=1,
                     num_threads=1) as loader:
        settings = loader.settings
    buffer = BatchBuffer(SampleLayout.of(np.zeros(1, np.int64)), 4)
    answers = Answers()
    return Pipeline(settings, {0: buffer}.__getitem__, answers.send, LoaderStats(), io_concurrency=1), buffer, answers


def hold_the_loop(pipeline: Pipeline) -> threading.Event:
    """Keeps the pipeline's event loop busy (the messages handled meanwhile wait for it, as a
    child's do when its control thread reads a burst) until the event returned is set."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        held.set()
        release.wait()

    pipeline.loop_thread.call_soon(hold)
    assert held.wait(ANSWER_WAIT_S)
    return release


def test_a_run_stopped_before_the_pipeline_took_its_start_confirms_its_stop_and_frees_its_reads():
    pipeline, buffer, answers = new_pipeline()
    try:
        release = hold_the_loop(pipeline)
        rows = [0, 1, 2, 3]
        pipeline.handle(Start(1, 0, None))
        pipeline.handle(Fill(1, 0, 0, rows, np.array([4, 5, 6, 7])))
        pipeline.handle(Stop(1))  # before the loop has seen the Start: nothing to mark yet
        release.set()
        assert answers.stopped.wait(ANSWER_WAIT_S), f"run 1's stop was never confirmed: {answers.got}"
        assert [m.run for m in answers.got if isinstance(m, Stopped)] == [1]
        assert pipeline.read_slots.inside == 0, "a cancelled read kept its slot"

        pipeline.handle(Start(2, 0, None))  # the next run's reads are not starved by the last one's
        pipeline.handle(Fill(2, 0, 0, rows, np.array([0, 1, 2, 3])))
        assert answers.done.wait(ANSWER_WAIT_S), f"run 2's fill never completed: {answers.got}"
        done = [m for m in answers.got if isinstance(m, Done)]
        assert [(m.run, m.fill, m.failures) for m in done] == [(2, 0, [])]
        assert buffer.tensors[0].flatten().tolist() == [0, 1, 2, 3]
    finally:
        assert pipeline.close() == [], "the pipeline's threads ended"


def test_a_run_stopped_as_the_pipeline_closes_confirms_its_stop_once():
    """A ``Stop`` and the pipeline's ``close()`` taken in one burst (a Ctrl-C at a run's end): the
    run's own stop and the shutdown's both stop it; ``Stopped`` goes out once per run (the
    shutdown's, one loop turn behind the run's own, found it gone and confirmed it again)."""
    pipeline, _, answers = new_pipeline()
    submitted = threading.Event()
    submit = pipeline.loop_thread.submit

    def submit_and_say(coroutine) -> bool:  # close() hands the loop its shutdown here
        done = submit(coroutine)
        submitted.set()
        return done

    pipeline.loop_thread.submit = submit_and_say
    release = hold_the_loop(pipeline)
    pipeline.handle(Start(1, 0, None))
    pipeline.handle(Start(2, 0, None))
    pipeline.handle(Stop(2))
    closing = threading.Thread(target=pipeline.close)
    closing.start()
    try:
        assert submitted.wait(ANSWER_WAIT_S)
    finally:
        release.set()
        closing.join(ANSWER_WAIT_S)
    assert not closing.is_alive()
    assert Counter(m.run for m in answers.got if isinstance(m, Stopped)) == {1: 1, 2: 1}
