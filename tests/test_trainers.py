"""An AsyncLoader inside the real trainers, used as their docs use a DataLoader: PyTorch
Lightning (one device, then DDP on 2 CPU processes, gloo: one run of ``lightning_ddp.py``, so
that Lightning, seconds of CPU to import, is imported by its two processes alone) and Hugging
Face Accelerate (2 processes, ``accelerate_run.py``). Every sample's content is its index, so
each delivered sample is identified."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
import warnings
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from asyncload import AsyncLoader
from asyncload.order.sampler import EpochSampler
import asyncload.trainers as trainers
from asyncload.trainers import EpochEnd
from tests import lightning_ddp
from tests.switching import force_switch

REPO = Path(__file__).resolve().parent.parent
RUN_TIMEOUT = 240.0  # seconds; a rank left waiting for another fails the test instead of hanging it
pytestmark = pytest.mark.timeout(RUN_TIMEOUT + 60)  # a 2-process run starts Python, torch and the trainer twice


def index_sample(i: int) -> np.ndarray:
    return np.full(2, i, np.float32)


def run_script(command: list[str], out: Path) -> str:
    """Runs a 2-process script; kills it and every process it started if it outlives RUN_TIMEOUT.
    Returns its output; fails the test (with the output) unless it exited with 0."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    process = subprocess.Popen(command, env=env, cwd=out, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = process.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        for child in psutil.Process(process.pid).children(recursive=True):
            child.kill()
        process.kill()
        output, _ = process.communicate()
        pytest.fail(f"the ranks did not finish within {RUN_TIMEOUT:.0f} s:\n{output[-4000:]}", pytrace=False)
    if process.returncode != 0:
        pytest.fail(f"exit status {process.returncode}:\n{output[-4000:]}", pytrace=False)
    return output


@pytest.fixture(scope="module")
def lightning_run(tmp_path_factory) -> dict:
    """``lightning_ddp.py``'s runs: ``single`` (one device), and ``stopped`` and ``resumed`` (DDP),
    each a list of what its ranks saw."""
    out = tmp_path_factory.mktemp("lightning")
    run_script([sys.executable, str(REPO / "tests" / "lightning_ddp.py"), str(out)], out)
    return {"single": json.loads((out / "single.json").read_text()),
            **{fit: [json.loads((out / f"{fit}.rank{rank}.json").read_text()) for rank in range(2)]
               for fit in ("stopped", "resumed")}}


def test_lightning_epoch_e_is_asyncload_epoch_e_and_every_evaluation_is_complete(lightning_run):
    """Lightning checks a loader by making an iterator and dropping it, and sets the epoch through
    ``loader.sampler.set_epoch``: trainer epoch e gets epoch e's order, every sample once; its
    validation, test and predict paths take the loader (``batch_sampler``, ``dataset``)."""
    seen, epochs = lightning_run["single"], [str(epoch) for epoch in range(lightning_ddp.SINGLE_EPOCHS)]
    assert seen["train"] == seen["orders"] and list(seen["orders"]) == epochs
    assert all(sorted(order) == list(range(lightning_ddp.SINGLE_ITEMS)) for order in seen["orders"].values())
    assert seen["fit_val"] == {epoch: list(range(lightning_ddp.SINGLE_VAL_ITEMS)) for epoch in epochs}, (
        "each epoch validates every sample once")
    assert seen["val"] == seen["test"] == seen["predict"] == {"0": list(range(lightning_ddp.SINGLE_VAL_ITEMS))}
    assert seen["threads_left"] == [], "threads left running once the loaders were closed"


def rank_order(rank: int, epoch: int) -> list[int]:
    """Rank ``rank`` of 2's order of ``epoch`` in ``lightning_ddp.py``'s training loader."""
    return EpochSampler(lightning_ddp.ITEMS, lightning_ddp.BATCH, shuffle=True, seed=5, drop_last=False, rank=rank,
                        world_size=2).order(epoch).tolist()


def test_lightning_ddp_ranks_take_disjoint_equal_halves_of_a_loader_built_before_fit(lightning_run):
    """Rank 0 built its loader with no distributed environment, rank 1 with Lightning's
    ``LOCAL_RANK``/``WORLD_SIZE`` and no ``RANK``: at the first batch both are ranks of 2."""
    first = lightning_run["stopped"]
    assert [rank["batches"] for rank in first] == [5, 5]
    halves = [rank["train"]["0"] for rank in first]
    assert halves == [rank_order(0, 0), rank_order(1, 0)], "trainer epoch 0 is asyncload's epoch 0 on each rank"
    assert sorted(halves[0] + halves[1]) == list(range(lightning_ddp.ITEMS))
    assert sorted(first[0]["val"]["0"] + first[1]["val"]["0"]) == list(range(lightning_ddp.VAL_ITEMS))


def test_lightning_ddp_resumes_both_ranks_from_rank_0s_checkpoint(lightning_run):
    """The checkpoint holds rank 0's loader state alone; both ranks go on where they stood."""
    stopped, resumed = lightning_run["stopped"], lightning_run["resumed"]
    for rank in range(2):
        assert list(resumed[rank]["train"]) == ["1"]
        assert stopped[rank]["train"]["1"] + resumed[rank]["train"]["1"] == rank_order(rank, 1)


@pytest.fixture(scope="module")
def accelerate_ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("accelerate")
    run_script([sys.executable, str(REPO / "tests" / "accelerate_run.py"), str(out)], out)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_accelerate_accumulation_syncs_where_a_prepared_dataloader_does(accelerate_ranks):
    for rank in accelerate_ranks:
        assert rank["dataloader_syncs"] == [[2, 5, 7], [2, 5, 7]]
        assert rank["asyncload_syncs"] == rank["dataloader_syncs"], "the epoch's end syncs, every epoch"


def test_accelerate_save_state_on_rank_0_resumes_every_rank(accelerate_ranks):
    from tests import accelerate_run  # here, not at the top: it imports Accelerate

    for rank in accelerate_ranks:
        assert rank["before"] + rank["after"] == rank["epoch_order"]
        assert len(rank["before"]) == accelerate_run.SAVE_AFTER * accelerate_run.BATCH
    assert sorted(accelerate_ranks[0]["epoch_order"] + accelerate_ranks[1]["epoch_order"]) == list(
        range(accelerate_run.ITEMS))


def test_accelerate_prepare_keeps_the_loader_and_skip_first_batches_names_the_resume(accelerate_ranks):
    for rank in accelerate_ranks:
        assert rank["prepare_returns_it"]
        assert "register_for_checkpointing" in rank["skip_first_batches"]


def test_what_the_trainers_read_has_honest_values():
    """``sampler.set_epoch`` is the loader's; ``batch_sampler`` lists the next pass's batches of
    source indices; ``dataset`` is the source's items and refuses to be read by a DataLoader."""
    with AsyncLoader(list(range(10)), batch_size=4, shuffle=True, seed=2, read=False, decode=index_sample,
                     drop_last=False) as loader:
        assert (loader.batch_size, loader.drop_last, len(loader.dataset)) == (4, False, 10)
        assert len(loader.batch_sampler) == len(loader) == 3
        assert loader.batch_sampler.sampler is loader.sampler
        loader.sampler.set_epoch(4)  # what Lightning calls
        planned = list(loader.batch_sampler)
        assert planned == [batch.tolist() for batch in loader.sampler.batches(4)]
        assert [batch[:, 0].long().tolist() for batch in loader] == planned
        assert list(loader.batch_sampler) == [batch.tolist() for batch in loader.sampler.batches(5)], "the next pass's"
        assert loader.dataset.items == list(range(10))
        with pytest.raises(TypeError, match="register_for_checkpointing"):
            loader.dataset[0]


@pytest.mark.parametrize("samples", [40, 400])  # the whole epoch under way before the switch; the switch mid-epoch
def test_a_switch_of_backends_still_announces_each_epochs_end_once(monkeypatch, samples):
    """``processes=None`` moving to children (forced at the second batch) near the epoch's end,
    when the plan is already used up (prefetch 16 > 10 batches), or mid-epoch: Accelerate's
    ``end_of_dataloader`` is set once per epoch, at its last batch."""
    real_last, announced = EpochEnd.last, []

    def last(self):
        announced.append(position[0])  # batches handed out before
        real_last(self)

    monkeypatch.setattr(EpochEnd, "last", last)
    force_switch(monkeypatch)
    position = [0]
    with AsyncLoader(list(range(samples)), batch_size=4, shuffle=False, read=False, decode=index_sample,
                     prefetch=16) as loader:
        for epoch in range(2):
            announced.clear()
            position[0] = 0
            for _ in loader:
                position[0] += 1
            assert announced == [len(loader) - 1], f"epoch {epoch}"  # as the last batch is about to go out
        assert loader._backend.processes == 2


class OtherGradientState:
    """An accelerate whose GradientState has none of the private calls asyncload uses."""


@pytest.mark.parametrize("attributes", [{}, {"is_initialized": lambda: True, "GradientState": OtherGradientState}])
def test_an_accelerate_without_the_private_calls_is_warned_about_once_and_the_epoch_runs(monkeypatch, attributes):
    """Another accelerate (its private ``is_initialized`` or ``GradientState._add_dataloader``
    gone): the passes run whole, with one warning naming the supported versions."""
    other = types.ModuleType("accelerate.state")
    for name, value in attributes.items():
        setattr(other, name, value)
    monkeypatch.setitem(sys.modules, "accelerate.state", other)
    monkeypatch.setattr(trainers, "_warned", [], raising=False)
    with AsyncLoader(list(range(10)), batch_size=4, shuffle=False, read=False, decode=index_sample,
                     processes=0) as loader:
        with pytest.warns(RuntimeWarning, match=r"lacks the GradientState calls .*supported: accelerate 1\.x.*"
                                                r"accumulation boundaries may drift"):
            assert [batch[:, 0].long().tolist() for batch in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert len(list(loader)) == 3  # once
