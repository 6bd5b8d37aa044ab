"""Many ranks: two real processes (gloo, CPU; started as PyTorch's DDP tutorial starts them), each
with its own AsyncLoader that takes rank and world size from torch.distributed
(``distributed_worker.py``). One run serves every test here; each test checks one promise
against what the ranks delivered."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import psutil
import pytest
from torch.utils.data import DistributedSampler

from asyncload.order.sampler import EpochSampler
from tests import distributed_worker as worker
from tests.conftest import PER_CLASS, image_colour, make_jpeg

REPO = Path(__file__).resolve().parent.parent
WORKER = Path(worker.__file__).resolve()
ITEMS = 23  # does not divide by two ranks nor by the batch size: padding and dropping both show
WORLD_SIZE = worker.WORLD_SIZE
RUN_TIMEOUT = 90.0  # seconds; a hang (e.g. a rank left alone in an all_reduce) fails the test


def colour(label: int) -> tuple[int, int, int]:
    return image_colour(*divmod(label, PER_CLASS))


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[list[dict] | None, str | None]:
    """Runs the worker on two ranks: (what each delivered, in rank order; None) on success,
    (None, what went wrong with every rank's stderr) otherwise."""
    root = tmp_path_factory.mktemp("distributed")
    items = []
    for label in range(ITEMS):
        path = root / f"{label}.jpg"
        path.write_bytes(make_jpeg(colour(label)))
        items.append([str(path), label])
    (root / "items.json").write_text(json.dumps(items))
    out = root / "out"
    out.mkdir()
    command = [sys.executable, str(WORKER), str(root / "items.json"), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    launcher = subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = launcher.communicate(timeout=RUN_TIMEOUT)
        problem = None if launcher.returncode == 0 else f"the ranks' launcher exited with {launcher.returncode}"
    except subprocess.TimeoutExpired:
        _kill_tree(launcher)
        output, _ = launcher.communicate()
        problem = f"the ranks did not finish within {RUN_TIMEOUT:.0f} s (a rank waiting for the other?)"
    results = [out / f"rank{rank}.json" for rank in range(WORLD_SIZE)]
    if problem is None and not all(path.exists() for path in results):
        problem = "a rank wrote no result"
    if problem is not None:
        logs = "".join(
            f"\n--- rank {rank} stderr ---\n{_read(out / f'rank{rank}.stderr')}" for rank in range(WORLD_SIZE)
        )
        return None, f"{problem}{logs}\n--- the launcher's output ---\n{output[-3000:]}"
    return [json.loads(path.read_text()) for path in results], None


@pytest.fixture
def ranks(run) -> list[dict]:
    results, problem = run
    if results is None:  # the whole report once, in test_ranks_run_to_the_end_in_step
        pytest.fail(f"{problem.splitlines()[0]}: see test_ranks_run_to_the_end_in_step for each rank's stderr",
                    pytrace=False)
    return results


def test_ranks_run_to_the_end_in_step(run):
    """Both ranks finish; a rank that fails, hangs or falls out of step with the other (a batch
    more or less) fails here, with each rank's stderr."""
    _, problem = run
    if problem is not None:
        pytest.fail(problem, pytrace=False)


def _kill_tree(process: subprocess.Popen) -> None:
    """Kills the launcher and the ranks it started."""
    try:
        children = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    process.kill()
    for child in children:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass


def _read(path: Path) -> str:
    return path.read_text()[-4000:] if path.exists() else "(no file: the rank did not start)"


def labels(batches: list) -> list[int]:
    return [label for batch in batches for label in batch["labels"]]


def expected_batches(drop_last: bool, epoch: int, rank: int) -> list[list[int]]:
    """This rank's batches as DistributedSampler would shard (without its own shuffle) the one
    permutation that a single, unsharded EpochSampler gives for (seed, epoch)."""
    single = EpochSampler(ITEMS, worker.BATCH_SIZE, shuffle=True, seed=worker.SEED, drop_last=False, rank=0, world_size=1)
    permutation = single.order(epoch).tolist()
    shard = DistributedSampler(permutation, num_replicas=WORLD_SIZE, rank=rank, shuffle=False, drop_last=drop_last)
    samples = [permutation[i] for i in shard]
    batches = [samples[i : i + worker.BATCH_SIZE] for i in range(0, len(samples), worker.BATCH_SIZE)]
    return [b for b in batches if len(b) == worker.BATCH_SIZE] if drop_last else batches


CASES = [(drop_last, epoch) for drop_last in (False, True) for epoch in (0, 1)]


def test_rank_and_world_size_come_from_torch_distributed(ranks):
    assert [r["rank"] for r in ranks] == list(range(WORLD_SIZE))
    assert [r["loader_rank"] for r in ranks] == [[rank, WORLD_SIZE] for rank in range(WORLD_SIZE)]


@pytest.mark.parametrize("drop_last, epoch", CASES)
def test_every_rank_gets_the_same_number_of_batches(ranks, drop_last, epoch):
    counts = [len(r["runs"][str(drop_last)]["epochs"][epoch]) for r in ranks]
    lengths = [r["runs"][str(drop_last)]["len"] for r in ranks]
    # 23 items: 12 a rank padded (3 batches of 4), or 11 a rank and the short batch dropped (2)
    assert counts == lengths == [2 if drop_last else 3] * WORLD_SIZE


@pytest.mark.parametrize("drop_last, epoch", CASES)
def test_ranks_are_disjoint_but_for_distributed_sampler_padding(ranks, drop_last, epoch):
    delivered = [labels(r["runs"][str(drop_last)]["epochs"][epoch]) for r in ranks]
    counts = Counter(label for shard in delivered for label in shard)
    repeated = {label: n for label, n in counts.items() if n > 1}
    if drop_last:
        assert repeated == {}, "with drop_last no sample may be on two ranks"
    else:
        # 23 samples on 2 ranks: the order is padded to 24 with its own first sample, which
        # thus ends rank 1's shard; nothing else may be repeated.
        first = EpochSampler(ITEMS, 1, shuffle=True, seed=worker.SEED, drop_last=False, rank=0, world_size=1).order(epoch)[0]
        assert repeated == {first: 2}
        assert delivered[1][-1] == first and delivered[0].count(first) == 1


@pytest.mark.parametrize("epoch", [0, 1])
def test_ranks_together_cover_the_dataset(ranks, epoch):
    delivered = {label for r in ranks for label in labels(r["runs"]["False"]["epochs"][epoch])}
    assert delivered == set(range(ITEMS))


@pytest.mark.parametrize("drop_last, epoch", CASES)
def test_all_ranks_shuffle_the_same_permutation(ranks, drop_last, epoch):
    """The ranks' batches are the shards of one permutation of (seed, epoch), so every rank
    shuffled identically."""
    for rank, r in enumerate(ranks):
        got = [batch["labels"] for batch in r["runs"][str(drop_last)]["epochs"][epoch]]
        assert got == expected_batches(drop_last, epoch, rank), f"rank {rank}"


@pytest.mark.parametrize("drop_last", [False, True])
def test_set_epoch_reshuffles(ranks, drop_last):
    for rank, r in enumerate(ranks):
        first, second = (labels(batches) for batches in r["runs"][str(drop_last)]["epochs"])
        assert first != second, f"rank {rank} delivered the same order in epochs 0 and 1"


@pytest.mark.parametrize("drop_last", [False, True])
def test_resume_continues_each_rank_exactly(ranks, drop_last):
    for rank, r in enumerate(ranks):
        resumed = r["resumed"][str(drop_last)]
        uninterrupted = [batch["labels"] for batch in r["runs"][str(drop_last)]["epochs"][1]]
        assert len(resumed["head"]) == worker.STOP_AFTER < len(uninterrupted)
        assert (resumed["state"]["rank"], resumed["state"]["epoch"]) == (rank, 1)
        assert resumed["head"] + resumed["tail"] == uninterrupted, f"rank {rank}"


def test_images_are_those_of_their_labels(ranks):
    palette = np.array([colour(label) for label in range(ITEMS)])
    for rank, r in enumerate(ranks):
        for runs in r["runs"].values():
            for batches in runs["epochs"]:
                for batch in batches:
                    pixels = np.array(batch["centre_pixels"])[:, None, :]
                    nearest = np.abs(pixels - palette[None]).sum(axis=2).argmin(axis=1)
                    assert nearest.tolist() == batch["labels"], f"rank {rank}"
