"""Which rank this process is, and of how many: what the user passed, else an initialised
``torch.distributed``, else a guess from torchrun's variables, looked at again when it matters.

A loader is often built, and even used, before the process group exists: a torchrun script
builds it before ``init_process_group``; PyTorch Lightning's docs build it before
``Trainer.fit``, in a process that is rank 0 of 1 until ``fit`` launches the others and
initialises the group, and a user may look at a batch or load a state before ``fit``. So only
what the user gave and what an initialised ``torch.distributed`` says are final (``settled``);
a guess from the environment is provisional, and looked at again at every pass's first
``next()`` and every ``state_dict`` / ``load_state_dict``, until ``torch.distributed`` replaces it.

The guess trusts torchrun's (and ``accelerate launch``'s) ``RANK`` and ``WORLD_SIZE`` only:
SLURM's and MPI's variables are also set around a plain ``python train.py`` in an sbatch step or
under ``mpirun`` that never joins a process group (``DistributedSampler`` ignores them too), where
they would silently train on a part of the data; once such a job initialises
``torch.distributed``, its values are the ones used. Lightning's launcher sets ``LOCAL_RANK`` and
``WORLD_SIZE`` but not ``RANK``: the rank is then unknown (``LOCAL_RANK`` is the global rank on
node 0 only), never guessed; if the group is still not initialised at the first ``next()``, the
error names the fix.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

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
    """The provisional ranks the environment gives: torchrun's ``RANK`` and ``WORLD_SIZE``, else
    ``WORLD_SIZE`` alone (Lightning's launcher: the rank is unknown), else one rank. SLURM's and
    MPI's variables are not read (the module's docstring says why)."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return Ranks(int(environ["RANK"]), int(environ["WORLD_SIZE"]), settled=False)
    world_size = int(environ.get("WORLD_SIZE", 1))
    if world_size == 1:
        return Ranks(0, 1, settled=False)
    local = environ.get("LOCAL_RANK")
    why = (f"WORLD_SIZE={world_size}" + (f" and LOCAL_RANK={local}" if local is not None else "")
           + " are set without RANK (as PyTorch Lightning's launcher does)")
    return Ranks(None, world_size, settled=False, unknown=why)


def decide(given: tuple[int | None, int | None], group: tuple[int, int] | None,
           environ: Mapping[str, str]) -> Ranks:
    """The ranks from what the user ``given`` (final), else the initialised process ``group``'s
    rank and world size (final), else a provisional guess from ``environ``."""
    rank, world_size = given
    if rank is not None and world_size is not None:
        return checked(Ranks(rank, world_size, settled=True))
    if group is not None:
        return checked(Ranks(group[0] if rank is None else rank, group[1] if world_size is None else world_size,
                             settled=True))
    guess = from_launcher(environ)
    if rank is not None or world_size is not None:  # one given: the other is only a guess until settled
        guess = Ranks(guess.rank if rank is None else rank, guess.world_size if world_size is None else world_size,
                      settled=False, unknown="" if rank is not None else guess.unknown)
    return checked(guess)


def find_ranks(rank: int | None, world_size: int | None, environ: Mapping[str, str] | None = None) -> Ranks:
    """The ranks now: ``rank``/``world_size`` where given, the rest from an initialised
    ``torch.distributed``, else provisionally from the environment (``os.environ`` as it is now)."""
    return decide((rank, world_size), distributed(), os.environ if environ is None else environ)


def settle(ranks: Ranks, given: tuple[int | None, int | None], strict: bool) -> Ranks:
    """The ranks when the loader is used: settled ones stay; provisional ones are looked at again
    (an initialised ``torch.distributed`` replaces them; else the environment's guess, still
    provisional). ``strict`` (a pass, a state): a rank still unknown is a ``ValueError`` naming
    the fix; else (``len()``) it may stay unknown."""
    if ranks.settled:
        return ranks
    now = find_ranks(*given)
    if now.rank is None and strict:
        raise ValueError(
            f"AsyncLoader cannot tell which rank this process is: {now.unknown}, and torch.distributed is "
            f"not initialised. Iterate after torch.distributed.init_process_group() (Lightning's Trainer.fit "
            f"does it before the first batch), or pass AsyncLoader(rank=..., world_size=...)")
    return now


def checked(ranks: Ranks) -> Ranks:
    if ranks.world_size < 1 or (ranks.rank is not None and not 0 <= ranks.rank < ranks.world_size):
        raise ValueError(f"rank must be in [0, world_size), got rank={ranks.rank}, world_size={ranks.world_size}")
    return ranks
