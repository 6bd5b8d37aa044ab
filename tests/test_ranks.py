"""Rank and world size: given, from an initialised torch.distributed, else provisionally from
torchrun's variables, looked at again at every pass and state call until torch.distributed
says; an unknown rank is never guessed, SLURM's and MPI's variables alone shard nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch.distributed as dist

from asyncload import AsyncLoader
from asyncload.order.ranks import Ranks, decide, find_ranks, from_launcher

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID", "SLURM_NTASKS",
                      "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE")


@pytest.fixture
def environ(monkeypatch):
    """No launcher's variables but those a test sets."""
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize("variables, found", [
    ({}, (0, 1)),
    ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}, (1, 4)),  # torchrun, accelerate launch
    ({"SLURM_PROCID": "3", "SLURM_NTASKS": "8"}, (0, 1)),  # a plain python in an sbatch step: the whole data
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}, (0, 1)),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3"}, (0, 1)),  # mpirun without a process group
    ({"PMI_RANK": "1", "PMI_SIZE": "2"}, (0, 1)),
    ({"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "5", "SLURM_NTASKS": "8"}, (0, 2)),  # torchrun inside srun
    ({"LOCAL_RANK": "0", "WORLD_SIZE": "1"}, (0, 1)),
])
def test_the_launchers_variables_give_provisional_ranks(variables, found):
    ranks = from_launcher(variables)
    assert (ranks.rank, ranks.world_size, ranks.settled) == (*found, False)


def test_lightnings_variables_without_rank_leave_the_rank_unknown():
    ranks = from_launcher({"LOCAL_RANK": "1", "WORLD_SIZE": "2", "NODE_RANK": "0"})
    assert (ranks.rank, ranks.world_size) == (None, 2)
    assert "WORLD_SIZE=2 and LOCAL_RANK=1 are set without RANK" in ranks.unknown


def test_a_guess_stays_provisional_until_torch_distributed_says():
    """Only the user's values and an initialised process group's are final; the environment's
    guess is provisional and gives way to the group's view whenever it is looked at again."""
    assert decide((None, None), None, {}) == Ranks(0, 1, settled=False)  # before Trainer.fit: a guess
    assert decide((None, None), (1, 2), {}) == Ranks(1, 2, settled=True)  # fit initialised the group
    assert decide((None, None), (1, 2), {"RANK": "0", "WORLD_SIZE": "4"}) == Ranks(1, 2, settled=True)
    assert decide((None, None), (0, 2), {"SLURM_PROCID": "3", "SLURM_NTASKS": "8"}) == Ranks(0, 2, settled=True)
    assert decide((None, 4), (1, 2), {}) == Ranks(1, 4, settled=True)  # what the user gave wins
    assert decide((1, 3), (0, 2), {}) == Ranks(1, 3, settled=True)


def test_given_ranks_are_settled_and_checked(environ):
    assert find_ranks(1, 3) == Ranks(1, 3, settled=True)
    with pytest.raises(ValueError, match="rank must be in"):
        find_ranks(2, 2)
    environ.setenv("RANK", "1")
    environ.setenv("WORLD_SIZE", "4")
    assert find_ranks(0, None) == Ranks(0, 4, settled=False)


def loader(**kwargs) -> AsyncLoader:
    return AsyncLoader(list(range(10)), batch_size=2, shuffle=False, read=False,
                       decode=lambda i: np.full(1, i, np.int64), **kwargs)


def test_an_unknown_rank_fails_at_the_first_next_naming_the_fix(environ):
    """Lightning's launcher environment without an initialised process group: len() is known
    (it needs the world size alone), the first batch is an error that says what to do."""
    environ.setenv("LOCAL_RANK", "1")
    environ.setenv("WORLD_SIZE", "2")
    with loader() as unknown:
        assert len(unknown) == 3
        batches = iter(unknown)  # nothing decided yet
        with pytest.raises(ValueError, match=r"cannot tell which rank .* LOCAL_RANK=1 .*init_process_group\(\).*"
                                             r"AsyncLoader\(rank=\.\.\., world_size=\.\.\.\)"):
            next(batches)
        with pytest.raises(ValueError, match="cannot tell which rank"):
            unknown.state_dict()
    with loader(rank=1) as given:  # the fix: the rank given, the world size from WORLD_SIZE
        assert [batch[:, 0].tolist() for batch in given] == [[1, 3], [5, 7], [9]]


def test_slurms_variables_alone_shard_nothing(environ):
    """A plain ``python train.py`` in an sbatch step of 4 tasks, no process group: the whole data,
    as ``DistributedSampler`` would (it does not read SLURM's variables either)."""
    environ.setenv("SLURM_PROCID", "1")
    environ.setenv("SLURM_NTASKS", "4")
    with loader() as whole:
        assert [batch[:, 0].tolist() for batch in whole] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
        assert whole.state_dict()["world_size"] == 1


def test_torchruns_variables_shard_a_loader_built_before_init_process_group(environ):
    environ.setenv("RANK", "1")
    environ.setenv("WORLD_SIZE", "2")
    with loader() as ranked:
        assert [batch[:, 0].tolist() for batch in ranked] == [[1, 3], [5, 7], [9]]


@pytest.fixture
def group(tmp_path):
    """Initialises a real gloo process group of this one process (rank 0 of 1), on demand."""
    def initialise():
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    yield initialise
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("look", ["next", "state_dict", "load_state_dict"])
def test_a_loader_used_before_the_group_exists_follows_the_group_once_it_does(environ, group, look):
    """A batch looked at, or a state taken or loaded, under the environment's guess (here rank 1
    of 2) does not pin it: once torch.distributed is initialised (rank 0 of 1), the next pass is
    the group's, the whole epoch."""
    environ.setenv("RANK", "1")
    environ.setenv("WORLD_SIZE", "2")
    with loader() as early:
        if look == "next":
            assert next(iter(early))[:, 0].tolist() == [1, 3]
        elif look == "state_dict":
            assert early.state_dict()["world_size"] == 2
        else:
            early.load_state_dict(early.state_dict())
            assert [batch[:, 0].tolist() for batch in early] == [[1, 3], [5, 7], [9]]  # resumed under the guess
        group()
        assert len(early) == 5
        assert [batch[:, 0].tolist() for batch in early] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
        assert early.state_dict()["world_size"] == 1


def test_a_state_loaded_under_a_guess_the_group_contradicts_is_refused(environ, group):
    environ.setenv("RANK", "1")
    environ.setenv("WORLD_SIZE", "2")
    with loader() as early:
        early.load_state_dict(early.state_dict())  # before the group: for rank 1 of 2, a guess
        group()
        with pytest.raises(ValueError, match=r"load_state_dict\(\) ran before torch.distributed was initialised, "
                                             r"for rank 1 of 2 .* this process is rank 0 of 1: call load_state_dict"
                                             r"\(\) after torch.distributed.init_process_group\(\)"):
            next(iter(early))
        with pytest.raises(ValueError, match="load_state_dict"):
            early.state_dict()  # it would describe the loaded state under the wrong ranks
        with loader() as now:
            early.load_state_dict(now.state_dict())  # loaded again after the group: accepted
        assert [batch[:, 0].tolist() for batch in early] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
