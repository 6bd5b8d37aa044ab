"""One measured run, in its own process: `python -m bench.harness.worker < spec.json`.

A fresh process per (workload, contender, config) keeps one contender's memory, threads, worker
processes and imports out of the next one's figures, and a contender that crashes takes only its
own row down. The spec comes on stdin; the result is written as JSON to spec["result_path"], and
a line per epoch (elapsed, rate) to stdout as each epoch ends: the bench's progress.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from bench.harness.contenders import CONTENDERS, RunData, batch_size_of
from bench.harness.dataset import DATA_ROOT, list_image_folder
from bench.harness.metrics import EpochStats, TreeSampler, summarise, timed_epoch
from bench.harness.workloads import S3_BUCKET, Workload
from tests.support.s3server import S3_ENV


def run_data(spec: dict, workload: Workload) -> RunData:
    """The item list every contender gets: local paths, or the same files' S3 URLs."""
    # Only the training loop moves batches to the GPU; elsewhere every contender stays on the CPU.
    data = RunData(device=spec.get("device", "cpu") if workload.name == "train" else "cpu")
    if workload.source == "synthetic":
        return data
    local_root = DATA_ROOT / workload.dataset
    items, _ = list_image_folder(local_root)
    if workload.source == "local":
        data.root, data.items = str(local_root), items
        return data
    prefix = f"s3://{S3_BUCKET}/{workload.shard_set if workload.samples_per_shard else workload.dataset}"
    data.root = prefix
    data.items = [(f"{prefix}/{Path(p).relative_to(local_root).as_posix()}", label) for p, label in items]
    data.storage_options = spec["storage_options"]
    return data


def make_consumer(workload: Workload, device: str) -> Callable[[Any], int]:
    """What the training loop does with a batch: nothing, or a simulated step (a sleep, which
    releases the GIL as a GPU step does, or pure-Python work, which holds it), or a real GPU
    step for the `train` workload."""
    if workload.name == "train":
        from bench.harness.train import gpu_consumer

        return gpu_consumer(workload)
    if workload.step_kind == "python":
        from bench.harness.steps import python_step

        loops = workload.python_loops

        def python_consume(batch: Any) -> int:
            python_step(loops)
            return batch_size_of(batch)

        return python_consume
    step = workload.step_s

    def consume(batch: Any) -> int:
        n = batch_size_of(batch)
        if step:
            time.sleep(step)
        return n

    return consume


def progress_writer() -> Callable[[str], None]:
    """Prints to this process's stdout, line-buffered, so each line reaches the bench's output as
    it is said; whatever a contender (or its worker processes) writes to stdout still goes to
    /dev/null, as before: fd 1 is duplicated for us, then pointed there."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)
    return lambda line: print(line, file=out)


def epoch_line(label: str, name: str, epoch: EpochStats) -> str:
    """One epoch as the progress shows it: how long it took and its rate."""
    return (f"    {label} | {name}: {epoch.samples} samples in {epoch.wall_s:.2f} s, "
            f"{epoch.samples_per_s:,.0f} samples/s")


def measure(spec: dict, say: Callable[[str], None] = lambda line: None) -> dict:
    """Build the loader, run a warm-up epoch, then as many measured epochs as the budget allows;
    ``say`` gets a line as each epoch ends."""
    workload = Workload(**spec["workload"])
    contender = CONTENDERS[spec["contender"]]
    config = spec["config"]
    data = run_data(spec, workload)
    consume = make_consumer(workload, data.device)
    alone = None
    if workload.step_kind == "python":  # the step's own time, before the loader runs
        from bench.harness.steps import time_alone

        alone = time_alone(workload.python_loops)
    sampler = TreeSampler()
    sampler.start()
    started = time.perf_counter()
    loader = contender.build(workload, config, data)
    build_s = time.perf_counter() - started
    try:
        label = spec.get("label", spec["contender"])
        warmup = timed_epoch(loader, 0, consume)
        say(epoch_line(label, "warm-up", warmup))
        fit = math.floor(workload.budget_s / max(warmup.wall_s, 1e-3))
        epochs = []
        for number in range(1, 1 + max(1, min(workload.epochs, fit))):
            epochs.append(timed_epoch(loader, number, consume))
            say(epoch_line(label, f"epoch {number}", epochs[-1]))
        if alone is not None:  # and again with the loader idle: the machine's drift evens out
            from bench.harness.steps import time_alone

            alone = (alone + time_alone(workload.python_loops)) / 2
        for number, epoch in enumerate([warmup, *epochs]):
            if epoch.samples != workload.samples:  # a loader that drops or repeats samples is wrong
                raise RuntimeError(f"epoch {number} delivered {epoch.samples} samples, expected {workload.samples}")
        # processes=None (asyncload's default): where it chose to run, and why
        choice = getattr(getattr(loader, "stats", None), "processes_choice", None)
    finally:
        loader.close()
        sampler.stop()
    result = summarise(epochs, warmup)
    if choice is not None:
        result["processes_choice"] = choice
    result.update(build_s=build_s, peak_rss_bytes=sampler.peak_rss, peak_pss_bytes=sampler.peak_pss)
    if alone is not None:
        result["step_alone_s"] = alone
    return result


def main() -> None:
    spec = json.load(sys.stdin)
    os.environ.update(S3_ENV)
    out = Path(spec["result_path"])
    say = progress_writer()
    try:
        result = {"ok": True, **measure(spec, say)}
    except BaseException as error:  # noqa: BLE001 - the report shows why a row is missing
        result = {"ok": False, "error": f"{type(error).__name__}: {error}",
                  "traceback": traceback.format_exc()[-4000:]}
    out.write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0 if result["ok"] else 1)  # do not wait on stuck non-daemon threads of a contender


if __name__ == "__main__":
    main()
