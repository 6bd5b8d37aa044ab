"""Where an epoch stands for the user: what was handed out, skipped, or repeated to fill the quota.

The driver updates it as each batch is handed out (never for a batch still in the pipeline), so
``state_dict()`` taken at any point describes exactly the batches the user has seen, and a resume
delivers the rest as the uninterrupted run would have. At another world size, the list of every
old rank's state resumes the samples none of them handed out (``resume_point``, ``order/elastic.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

from ..order.elastic import Elastic
from ..order.epoch_size import EpochSize
from ..order.positions import Positions


@dataclass
class EpochLedger:
    """The epoch's positions handed out as themselves (``done``), skipped (failed and not retried:
    on the failure budget) and delivered again to fill the DDP batch quota (``repeated``: a resumed
    rank repeats on past them; ``"padded"`` in ``state_dict()``), and the batches handed out."""

    done: Positions = field(default_factory=Positions)
    skipped: Positions = field(default_factory=Positions)
    repeated: Positions = field(default_factory=Positions)
    batches: int = 0

    def handed_out(self, positions: Iterable[int], skipped: Iterable[int], repeated: Iterable[int]) -> None:
        """A batch reached the user (``positions``, of which ``repeated`` came as repeats), or was
        dropped (no ``positions``). A position delivered as a repeat is not done as itself: a
        rank that repeats early (samples failed) still owes it, as the uninterrupted run would."""
        as_itself = list(positions)
        for position in repeated:
            if position in as_itself:
                as_itself.remove(position)
        self.done.add(as_itself)
        self.skipped.add(skipped)
        self.repeated.add(repeated)

    def as_state(self) -> dict[str, Any]:
        return {"delivered": self.done.intervals(), "batches": self.batches, "skipped": self.skipped.intervals(),
                "padded": self.repeated.intervals()}

    @classmethod
    def from_state(cls, state: dict[str, Any], batch_size: int) -> "EpochLedger":
        """From ``as_state()`` (older states lack ``skipped``, ``padded`` or ``batches``)."""
        done = Positions(state["delivered"])
        return cls(done, Positions(state.get("skipped", [])), Positions(state.get("padded", [])),
                   state.get("batches", len(done) // batch_size))


def check_resumable(state: dict[str, Any], mine: dict[str, Any],
                    keys: tuple[str, ...] = ("seed", "samples_per_rank", "batch_size", "rank", "world_size")) -> None:
    """Refuses (``ValueError``) a ``state`` saved by a loader whose order differs from this one's
    (``mine``, its own state): resuming would skip some samples and repeat others, silently."""
    for key in keys:
        if state[key] != mine[key]:
            raise ValueError(f"state_dict was saved with {key}={state[key]}, this loader has {mine[key]}")
    for key, value in state.get("order", mine["order"]).items():  # states saved before it had none
        if mine["order"].get(key) != value:
            raise ValueError(f"state_dict was saved with {key}={value!r}, this loader has "
                             f"{mine['order'].get(key)!r}: resuming would follow another order")


def resume_point(saved: dict[str, Any] | list[dict[str, Any]], sampler: Any,
                 mine: dict[str, Any]) -> tuple[dict[str, Any], Elastic | None]:
    """What ``load_state_dict(saved)`` resumes: a state of this rank's and, when the epoch goes on
    at another world size than it began, the ``Elastic`` rest it runs. ``saved``: this rank's
    ``state_dict()`` (same world size), or the list of every old rank's (any world size; one
    rank's alone cannot say what the others delivered). ``ValueError`` names what is wrong."""
    if isinstance(saved, dict) and saved["world_size"] == sampler.world_size:
        if saved["rank"] != sampler.rank:
            saved = as_rank(saved, sampler.rank)
        check_resumable(saved, mine)
        return saved, Elastic.from_state(saved.get("elastic"))
    states = [saved] if isinstance(saved, dict) else list(saved)
    if not states or not all(isinstance(state, dict) for state in states):
        raise ValueError("load_state_dict takes a state_dict() or the list of every rank's state_dict()")
    old = states[0]["world_size"]
    if isinstance(saved, dict) and old != 1:  # one old rank's state is all of them only if it was alone
        raise ValueError(
            f"this state_dict is rank {saved['rank']}'s of {old} ranks, and this loader has world_size="
            f"{sampler.world_size}: to resume at another world size, pass load_state_dict the list of all "
            f"{old} old ranks' state_dict()s (ranks 0 to {old - 1}), from the same step")
    ranks = sorted(state["rank"] for state in states)
    if any(state["world_size"] != old for state in states) or ranks != list(range(old)):
        raise ValueError(f"load_state_dict needs the state_dict() of each old rank once: ranks 0 to {old - 1} of "
                         f"world_size={old}; got ranks {ranks} of world sizes "
                         f"{sorted({state['world_size'] for state in states})}")
    for key in ("epoch", "seed", "batch_size", "samples_per_rank", "order", "elastic"):
        values = [state.get(key) for state in states]
        if any(value != values[0] for value in values):
            raise ValueError(f"the old ranks' state_dicts disagree on {key}: {values} (not saved at the same step "
                             "of the same job?)")
    states.sort(key=lambda state: state["rank"])
    if old == sampler.world_size:
        state = states[sampler.rank]
        check_resumable(state, mine)
        return state, Elastic.from_state(state.get("elastic"))
    old_state = states[0]
    check_resumable(old_state, mine, keys=("seed", "batch_size"))
    expected = sampler.size.of(sampler.num_items, old).per_rank
    if old_state["samples_per_rank"] != expected:
        raise ValueError(f"state_dict was saved with samples_per_rank={old_state['samples_per_rank']}, "
                         f"{old} ranks of this loader's source have {expected}")
    fresh = {"epoch": old_state["epoch"], "delivered": [], "batches": 0, "skipped": [], "padded": []}
    earlier = Elastic.from_state(old_state.get("elastic"))
    if earlier is None and not any(state["delivered"] or state.get("skipped") for state in states):
        return fresh, None  # the epoch had not begun: it begins at the new world size
    return fresh, Elastic(old, states, earlier)


def as_rank(state: dict[str, Any], rank: int) -> dict[str, Any]:
    """Another rank's ``state`` (same world size) as this ``rank``'s: what a checkpoint saved on
    rank 0 alone gives every rank (Lightning, Accelerate, ``if rank == 0: torch.save(...)``). DDP
    keeps the ranks in step, so where the state is ``in_step`` this rank handed out the same
    positions of its own order; else (skips, batches out of order) only every rank's state says
    where each stands: ``ValueError`` says how to gather them. No collective here: a rank that
    refuses leaves none of the others waiting in one of ours."""
    if state.get("in_step"):
        return {**state, "rank": rank}
    if state.get("skipped") or state.get("padded"):
        why = "it skipped samples, which moves a rank's positions apart from the others'"
    elif "in_step" not in state:
        why = "it was saved by an older asyncload, which did not record whether the ranks were in step"
    else:
        why = ("with on_error='skip' or in_order=False, or after an elastic resume, each rank's positions are "
               "its own")
    world = state["world_size"]
    raise ValueError(
        f"this state_dict is rank {state['rank']}'s of {world}, and this loader is rank {rank}: {why}, so rank "
        f"{state['rank']}'s state does not say where rank {rank} stands. Save every rank's state_dict() and give "
        f"load_state_dict the list of all {world} (the same list on every rank): e.g. on every rank, states = "
        f"[None] * {world}; torch.distributed.all_gather_object(states, loader.state_dict()), then save states "
        f"from rank 0; or save one file per rank")


class Epochs:
    """Which epoch each pass over the loader runs, and what it handed out so far (``ledger``).

    A new pass is the next epoch, as a new pass of ``DataLoader(shuffle=True)`` is a new order,
    unless ``set_epoch`` or ``load_state_dict`` chose it: ``choose`` runs that epoch from its start
    (a different epoch) or keeps a resume (the loaded one); ``load`` continues where a saved state
    stood. ``epoch`` is what ``state_dict()`` records: the epoch of the pass running or left, or,
    after a pass that ended, the next one with nothing delivered. With ``elastic`` (the epoch began
    at another world size) the pass runs that rest, ``ledger`` holds positions of its order, and
    ``state_dict()`` records it; it lasts until a pass starts or ends without resuming."""

    def __init__(self) -> None:
        self.epoch = 0
        self.chosen = True  # the next pass runs self.epoch (else self.epoch + 1): no pass of it yet
        self.ledger = EpochLedger()
        self.resume = False  # set by load(): the next pass continues self.ledger
        self.elastic: Elastic | None = None  # the rest of an epoch begun at another world size

    def choose(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch = epoch
            self.ledger, self.resume, self.elastic = EpochLedger(), False, None
        self.chosen = True

    def state(self, sampler: Any, order_identity: dict[str, Any], in_step: bool = False) -> dict[str, Any]:
        """``state_dict()``: the epoch, its ledger and the settings that decide its order.
        ``in_step``: batches come in order and a failure raises (no skip), so every rank that
        handed out as many batches of the epoch stands at the same positions of its own order:
        this state then resumes any rank (``in_step``)."""
        ledger = self.ledger
        contiguous = ledger.done.intervals() in ([], [[0, len(ledger.done)]])
        return {"epoch": self.epoch, "seed": sampler.seed, "samples_per_rank": sampler.samples_per_rank,
                "batch_size": sampler.batch_size, "rank": sampler.rank, "world_size": sampler.world_size,
                **ledger.as_state(), "order": dict(order_identity),
                **({} if self.elastic is None else {"elastic": self.elastic.as_state()}),
                "in_step": bool(in_step and contiguous and self.elastic is None and not len(ledger.skipped)
                                      and not len(ledger.repeated))}

    def upcoming(self) -> int:
        """The epoch the next pass runs (unless ``set_epoch`` or ``load_state_dict`` says otherwise)."""
        return self.epoch if self.chosen else self.epoch + 1

    def load(self, state: dict[str, Any], batch_size: int, elastic: Elastic | None = None) -> None:
        """Resume ``state``; with ``elastic``, its positions are those of that rest's order."""
        self.epoch, self.chosen = state["epoch"], True
        self.ledger, self.resume = EpochLedger.from_state(state, batch_size), True
        self.elastic = elastic

    def plan(self, sampler: Any, epoch: int) -> tuple[np.ndarray, EpochSize]:
        """The pass's order and its arithmetic: the epoch's at this world size, or the rest of
        an epoch begun at another (its batches, equal on every new rank, fewer than ``len``)."""
        if self.elastic is None:
            size = sampler.size
            return sampler.order(epoch)[: size.per_rank], size
        return self.elastic.dealt(sampler, epoch)

    def start_pass(self) -> int:
        """A pass begins: its epoch (``ledger`` is what it has to go on from)."""
        if not self.chosen:  # a pass of this epoch ran: a new pass is the next epoch
            self.epoch, self.resume = self.epoch + 1, False
        if not self.resume:  # as with DataLoader, a new iteration starts the epoch afresh
            self.ledger, self.elastic = EpochLedger(), None
        self.chosen = self.resume = False
        return self.epoch

    def pass_ended(self, epoch: int, latest: bool) -> None:
        """Pass ``epoch`` delivered its whole epoch; ``latest``: no newer pass started meanwhile.
        ``state_dict()`` now points at the next epoch, unless the user chose one already."""
        self.ledger, self.elastic = EpochLedger(), None
        if latest and not self.chosen:
            self.epoch, self.chosen = epoch + 1, True
