"""Rank and world size: given, from an initialised torch.distributed, else provisionally from the
launchers' variables, decided at the first next(); an unknown rank is never guessed."""

from __future__ import annotations

import numpy as np
import pytest

from asyncload import AsyncLoader
from asyncload.order.ranks import Ranks, find_ranks, from_launcher

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
    ({"SLURM_PROCID": "3", "SLURM_NTASKS": "8"}, (3, 8)),  # srun
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3"}, (2, 3)),  # mpirun
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


def test_torchruns_variables_shard_a_loader_built_before_init_process_group(environ):
    environ.setenv("RANK", "1")
    environ.setenv("WORLD_SIZE", "2")
    with loader() as ranked:
        assert [batch[:, 0].tolist() for batch in ranked] == [[1, 3], [5, 7], [9]]
