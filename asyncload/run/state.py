"""Where an epoch stands for the user: what was handed out, what was skipped, what was padded.

The driver updates it as each batch is handed out (never for a batch still in the pipeline), so
``state_dict()`` taken at any point describes exactly the batches the user has seen, and a resume
delivers the rest as the uninterrupted run would have.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from ..order.positions import Positions


@dataclass
class Progress:
    """The epoch's positions handed out as themselves (``done``), skipped (failed and not retried:
    on the failure budget) and delivered as DDP padding (a resumed rank pads on past them), and
    the batches handed out."""

    done: Positions = field(default_factory=Positions)
    skipped: Positions = field(default_factory=Positions)
    padded: Positions = field(default_factory=Positions)
    batches: int = 0

    def handed_out(self, positions: Iterable[int], skipped: Iterable[int], padded: Iterable[int]) -> None:
        """A batch reached the user (``positions``, of which ``padded`` came as padding), or was
        dropped (no ``positions``). A position delivered as padding is not done as itself: a
        rank that pads early (samples failed) still owes it, as the uninterrupted run would."""
        as_itself = list(positions)
        for position in padded:
            if position in as_itself:
                as_itself.remove(position)
        self.done.add(as_itself)
        self.skipped.add(skipped)
        self.padded.add(padded)

    def as_state(self) -> dict[str, Any]:
        return {"delivered": self.done.intervals(), "batches": self.batches, "skipped": self.skipped.intervals(),
                "padded": self.padded.intervals()}

    @classmethod
    def from_state(cls, state: dict[str, Any], batch_size: int) -> "Progress":
        """From ``as_state()`` (older states lack ``skipped``, ``padded`` or ``batches``)."""
        done = Positions(state["delivered"])
        return cls(done, Positions(state.get("skipped", [])), Positions(state.get("padded", [])),
                   state.get("batches", len(done) // batch_size))


def check_resumable(state: dict[str, Any], mine: dict[str, Any]) -> None:
    """Refuses (``ValueError``) a ``state`` saved by a loader whose order differs from this one's
    (``mine``, its own state): resuming would skip some samples and repeat others, silently."""
    for key in ("seed", "samples_per_rank", "batch_size", "rank", "world_size"):
        if state[key] != mine[key]:
            raise ValueError(f"state_dict was saved with {key}={state[key]}, this loader has {mine[key]}")
    for key, value in state.get("order", mine["order"]).items():  # states saved before it had none
        if mine["order"].get(key) != value:
            raise ValueError(f"state_dict was saved with {key}={value!r}, this loader has "
                             f"{mine['order'].get(key)!r}: resuming would follow another order")


class Epochs:
    """Which epoch each pass over the loader runs, and what it handed out so far (``progress``).

    A new pass is the next epoch, as a new pass of ``DataLoader(shuffle=True)`` is a new order,
    unless ``set_epoch`` or ``load_state_dict`` chose it: ``choose`` runs that epoch from its start
    (a different epoch) or keeps a resume (the loaded one); ``load`` continues where a saved state
    stood. ``epoch`` is what ``state_dict()`` records: the epoch of the pass running or left, or,
    after a pass that ended, the next one with nothing delivered."""

    def __init__(self) -> None:
        self.epoch = 0
        self.chosen = True  # the next pass runs self.epoch (else self.epoch + 1): no pass of it yet
        self.progress = Progress()
        self.resume = False  # set by load(): the next pass continues self.progress

    def choose(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch = epoch
            self.progress, self.resume = Progress(), False
        self.chosen = True

    def state(self, sampler: Any, order_identity: dict[str, Any]) -> dict[str, Any]:
        """``state_dict()``: the epoch, its progress and the settings that decide its order."""
        return {"epoch": self.epoch, "seed": sampler.seed, "samples_per_rank": sampler.samples_per_rank,
                "batch_size": sampler.batch_size, "rank": sampler.rank, "world_size": sampler.world_size,
                **self.progress.as_state(), "order": dict(order_identity)}

    def load(self, state: dict[str, Any], batch_size: int) -> None:
        self.epoch, self.chosen = state["epoch"], True
        self.progress, self.resume = Progress.from_state(state, batch_size), True

    def start_pass(self) -> int:
        """A pass begins: its epoch (``progress`` is what it has to go on from)."""
        if not self.chosen:  # a pass of this epoch ran: a new pass is the next epoch
            self.epoch, self.resume = self.epoch + 1, False
        if not self.resume:  # as with DataLoader, a new iteration starts the epoch afresh
            self.progress = Progress()
        self.chosen = self.resume = False
        return self.epoch

    def pass_ended(self, epoch: int, latest: bool) -> None:
        """Pass ``epoch`` delivered its whole epoch; ``latest``: no newer pass started meanwhile.
        ``state_dict()`` now points at the next epoch, unless the user chose one already."""
        self.progress = Progress()
        if latest and not self.chosen:
            self.epoch, self.chosen = epoch + 1, True
