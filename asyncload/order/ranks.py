"""Which rank this process is, and of how many: what the user passed, else an initialised
``torch.distributed``, else the variables the launchers set, looked at again when it matters.

A loader is often built before the process group exists: a torchrun script builds it before
``init_process_group``; PyTorch Lightning's docs build it before ``Trainer.fit``, in a process
that is rank 0 of 1 until ``fit`` launches the others and initialises the group. So a value that
did not come from the user or from ``torch.distributed`` is provisional: it gives ``len()`` until
the first ``next()`` (or ``state_dict`` / ``load_state_dict``), where an initialised
``torch.distributed`` replaces it. Lightning's launcher sets ``LOCAL_RANK`` and ``WORLD_SIZE``
but not ``RANK``: the rank is then unknown (``LOCAL_RANK`` is the global rank on node 0 only),
never guessed; if the group is still not initialised at the first ``next()``, the error names
the fix.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

# (rank variable, world size variable, the launcher that sets them), in the order they are trusted
LAUNCHERS = (
    ("RANK", "WORLD_SIZE", "torchrun"),
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM's srun"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "Open MPI's mpirun"),
    ("PMI_RANK", "PMI_SIZE", "MPICH / Intel MPI's mpirun"),
)


@dataclass
class Ranks:
    """``rank`` of ``world_size``; ``settled``: given or from ``torch.distributed``, final.
    ``rank`` is None while it cannot be known (``unknown`` says why)."""

    rank: int | None
    world_size: int
    settled: bool
    unknown: str = ""


def distributed() -> tuple[int, int] | None:
    """An initialised ``torch.distributed``'s rank and world size, else None."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


def from_launcher(environ: Mapping[str, str]) -> Ranks:
    """The provisional ranks the environment gives: a launcher's pair of variables, else
    ``WORLD_SIZE`` alone (Lightning's launcher: the rank is unknown), else one rank."""
    for rank_name, size_name, _ in LAUNCHERS:
        if rank_name in environ and size_name in environ:
            return Ranks(int(environ[rank_name]), int(environ[size_name]), settled=False)
    world_size = int(environ.get("WORLD_SIZE", 1))
    if world_size == 1:
        return Ranks(0, 1, settled=False)
    local = environ.get("LOCAL_RANK")
    why = (f"WORLD_SIZE={world_size}" + (f" and LOCAL_RANK={local}" if local is not None else "")
           + " are set without RANK (as PyTorch Lightning's launcher does)")
    return Ranks(None, world_size, settled=False, unknown=why)


def find_ranks(rank: int | None, world_size: int | None, environ: Mapping[str, str] | None = None) -> Ranks:
    """The ranks at construction: ``rank``/``world_size`` where given, the rest from an initialised
    ``torch.distributed``, else provisionally from the environment."""
    if rank is not None and world_size is not None:
        return checked(Ranks(rank, world_size, settled=True))
    found = distributed()
    if found is not None:
        return checked(Ranks(found[0] if rank is None else rank, found[1] if world_size is None else world_size,
                             settled=True))
    guess = from_launcher(os.environ if environ is None else environ)
    if rank is not None or world_size is not None:  # one given: the other is only a guess until settled
        guess = Ranks(guess.rank if rank is None else rank, guess.world_size if world_size is None else world_size,
                      settled=False, unknown="" if rank is not None else guess.unknown)
    return checked(guess)


def settle(ranks: Ranks, given: tuple[int | None, int | None], strict: bool) -> Ranks:
    """The ranks once the loader is used: an initialised ``torch.distributed``'s (for what the
    user did not give) replace provisional ones. ``strict`` (a pass, a state): a rank still
    unknown is a ``ValueError`` naming the fix; else (``len()``) provisional ones stay."""
    if ranks.settled:
        return ranks
    found = distributed()
    if found is not None:
        rank, world_size = given
        return checked(Ranks(found[0] if rank is None else rank, found[1] if world_size is None else world_size,
                             settled=True))
    if ranks.rank is None:
        if strict:
            raise ValueError(
                f"AsyncLoader cannot tell which rank this process is: {ranks.unknown}, and torch.distributed is "
                f"not initialised. Iterate after torch.distributed.init_process_group() (Lightning's Trainer.fit "
                f"does it before the first batch), or pass AsyncLoader(rank=..., world_size=...)")
        return ranks
    return Ranks(ranks.rank, ranks.world_size, settled=strict)


def checked(ranks: Ranks) -> Ranks:
    if ranks.world_size < 1 or (ranks.rank is not None and not 0 <= ranks.rank < ranks.world_size):
        raise ValueError(f"rank must be in [0, world_size), got rank={ranks.rank}, world_size={ranks.world_size}")
    return ranks
