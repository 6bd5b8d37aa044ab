"""The two ranks of ``tests/test_distributed.py``:

    python tests/distributed_worker.py ITEMS OUT

starts them as PyTorch's DDP tutorial does (``torch.multiprocessing``, each rank given ``RANK``
and ``WORLD_SIZE``; they meet through a file in ``OUT``, not a port picked beforehand, which
another process could take before rank 0 listens on it), forked from this process once it has
imported torch and asyncload: torchrun would start a launcher and two fresh interpreters, three
imports of torch (about 2 s of CPU each on a 2-core box) for what one import serves here.

``ITEMS`` is a JSON list of ``[path, label]``; each rank writes ``OUT/rank<r>.json`` (what it
delivered) and ``OUT/rank<r>.stderr`` (everything it wrote to standard error). Each rank builds
its own AsyncLoader without rank or world size, as a training script would, and joins an
all_reduce per batch as DDP does, so a rank with fewer batches fails the run. A rank that raises
ends the other and the run (``start_processes``), with a non-zero exit status.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing

from asyncload import AsyncLoader, ImageDecoder

BATCH_SIZE = 4
SEED = 3
STOP_AFTER = 1  # batches delivered before the "interruption" of the resume check
COLLECTIVE_TIMEOUT = timedelta(seconds=30)  # a rank left waiting fails instead of hanging
WORLD_SIZE = 2


def main(items_path: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out_dir, 'rendezvous')}",
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=COLLECTIVE_TIMEOUT)
    rank = dist.get_rank()
    with open(items_path) as f:
        source = [(path, label) for path, label in json.load(f)]

    def make_loader(drop_last: bool) -> AsyncLoader:
        # no rank / world_size: they come from torch.distributed
        return AsyncLoader(source, batch_size=BATCH_SIZE, seed=SEED, drop_last=drop_last,
                           decode=ImageDecoder(16), num_threads=1)

    def step(phase: int, epoch: int, batch: int) -> None:
        """What DDP does each step: an all_reduce every rank must join. It carries where this
        rank is, so ranks out of step fail here at once rather than pairing one rank's last
        batch with the other's next epoch (and hanging only at the very end)."""
        where = torch.tensor([phase, epoch, batch], dtype=torch.int64)
        extremes = torch.cat([where, -where])
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
        highest, lowest = extremes[:3], -extremes[3:]
        if not torch.equal(highest, lowest):
            raise RuntimeError(
                f"ranks out of step: rank {rank} is at (phase, epoch, batch) = {where.tolist()}, "
                f"the ranks range from {lowest.tolist()} to {highest.tolist()} (batch -1: epoch ended)"
            )

    result: dict = {"rank": rank, "world_size": dist.get_world_size(), "runs": {}, "resumed": {}}
    for phase, drop_last in enumerate((False, True)):
        with make_loader(drop_last) as loader:
            result["loader_rank"] = [loader.sampler.rank, loader.sampler.world_size]
            epochs = []
            for epoch in range(2):
                loader.set_epoch(epoch)
                batches = []
                for images, labels in loader:
                    step(phase, epoch, len(batches))
                    centre = images[:, images.shape[1] // 2, images.shape[2] // 2].tolist()
                    batches.append({"labels": labels.tolist(), "centre_pixels": centre})
                step(phase, epoch, -1)
                epochs.append(batches)
            result["runs"][str(drop_last)] = {"len": len(loader), "epochs": epochs}

            # Interrupted in epoch 1 after STOP_AFTER batches; the state goes into the checkpoint.
            loader.set_epoch(1)
            head = []
            for _, labels in loader:
                step(phase, 1, len(head))
                head.append(labels.tolist())
                if len(head) == STOP_AFTER:
                    break
            state = json.loads(json.dumps(loader.state_dict()))
        # After the restart: a new loader, the saved state, and the training loop as before.
        with make_loader(drop_last) as resumed:
            resumed.load_state_dict(state)
            resumed.set_epoch(1)  # the loop's own call for the epoch it resumes in
            tail = []
            for _, labels in resumed:
                step(phase, 1, len(head) + len(tail))
                tail.append(labels.tolist())
            step(phase, 1, -1)
        result["resumed"][str(drop_last)] = {"head": head, "tail": tail, "state": state}

    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def rank_main(rank: int, items_path: str, out_dir: str) -> None:
    """Rank ``rank``, just forked: everything it writes to standard error (warnings, tracebacks,
    gloo's messages) goes to a file of its own, which the test shows when the run fails."""
    stderr = open(os.path.join(out_dir, f"rank{rank}.stderr"), "w", buffering=1)
    os.dup2(stderr.fileno(), 2)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE))
    main(items_path, out_dir)


if __name__ == "__main__":
    items_path, out_dir = sys.argv[1:3]
    torch.multiprocessing.start_processes(rank_main, args=(items_path, out_dir), nprocs=WORLD_SIZE,
                                          start_method="fork")
