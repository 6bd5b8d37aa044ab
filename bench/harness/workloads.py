"""The workloads, in a quick and a full size.

Sizes are set so that `python -m bench --quick` ends in under 3 minutes and `python -m bench` in
under 15 on a 2-core machine, sweeps included; every epoch still holds several batches so that the
pipeline's steady state, not its start-up, dominates the figures.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from bench.harness.dataset import ImageSetSpec

S3_BUCKET = "asyncload-bench"
S3_LATENCY = (0.02, 0.05)
LARGE_IO_S = 0.003125
LARGE_SHAPE = (1000, 150)
LARGE_STEP_S = 0.05
PYTHON_STEP_S = 0.025


@dataclass(frozen=True)
class Workload:
    """One measured scenario. `source` is "local", "s3", "s3-latency" or "synthetic"."""

    name: str
    title: str
    source: str
    dataset: str  # image set name: bench/data/<dataset>/, and the S3 prefix for S3 sources
    batch_size: int
    samples: int  # per epoch
    epochs: int  # measured epochs at most, after one warm-up epoch
    step_s: float = 0.0  # simulated training step per batch
    step_kind: str = "sleep"  # "sleep" (releases the GIL, as a GPU step) or "python" (holds it)
    python_loops: int = 0  # a "python" step's work, calibrated to step_s by `python -m bench`
    budget_s: float = 10.0  # measured epochs are cut to fit this, but at least one is run
    note: str = ""
    samples_per_shard: int = 0  # > 0: the image set is read as tar shards of this many samples

    @property
    def shard_set(self) -> str:
        """Where the shards are: bench/data/<shard_set>/ and the S3 prefix of that name."""
        return f"{self.dataset}-shards{self.samples_per_shard}"

    @property
    def is_image(self) -> bool:
        return self.source != "synthetic"

    def to_dict(self) -> dict:
        return asdict(self)


def image_set(quick: bool) -> ImageSetSpec:
    """The local JPEG folder; quick and full runs use separate folders so each is a whole
    image_folder() of exactly the size measured."""
    if quick:
        return ImageSetSpec("imagenet-like-quick", count=512, classes=16)
    return ImageSetSpec("imagenet-like", count=2048, classes=64)


def s3_image_set(quick: bool) -> ImageSetSpec:
    """The smaller set, for the latency workloads (2 DataLoader workers behind 20-50 ms manage
    ~40 images/s; 288 images are still 6 batches of 48, so 4 workers all work) and the
    consumer-bound ones. Plain S3 reads the local set, so the two compare directly."""
    if quick:
        return ImageSetSpec("imagenet-like-s3-quick", count=192, classes=8)
    return ImageSetSpec("imagenet-like-s3", count=288, classes=16)


S3_NOTE = ("S3 is SeaweedFS, a Go S3 server on the same cores (keeps connections alive, serves "
           "thousands of GETs/s); asyncload reads through obstore by default, DataLoader through s3fs")


def workloads(quick: bool) -> list[Workload]:
    """All workloads, in run order. The consumer-bound and Python-step ones read the smaller (S3)
    set from local disk: their epochs last as long as the simulated steps, so fewer samples keep
    them short."""
    img, s3 = image_set(quick), s3_image_set(quick)
    batch = 64 if quick else 256
    s3_batch = 32 if quick else 48  # S3 sets are smaller; keep >= 6 batches so 4 workers all work
    epochs = 1 if quick else 3  # measured, after a warm-up epoch; quick numbers are indicative only
    short = 1 if quick else 5  # for epochs under a second, whose medians a noisy VM moves most
    step = 0.004 * s3_batch  # 4 ms/sample: ~3x slower than decoding on 2 cores
    return [
        Workload("imagenet-local", "ImageNet-like JPEGs, local disk (decode + RRC224 + flip)",
                 "local", img.name, batch, img.count, epochs, budget_s=4 if quick else 8),
        Workload("imagenet-s3", "Same from S3 (local SeaweedFS server)", "s3", img.name, batch, img.count,
                 epochs, budget_s=4 if quick else 8, note=S3_NOTE),
        Workload("imagenet-s3-latency", "Same from S3 behind 20-50 ms first-byte latency",
                 "s3-latency", s3.name, s3_batch, s3.count, epochs, budget_s=3 if quick else 6,
                 note=S3_NOTE),
        Workload("shards-s3-latency", "Same images as tar shards from S3 behind 20-50 ms first-byte latency",
                 "s3-latency", s3.name, s3_batch, s3.count, short, budget_s=3 if quick else 6,
                 samples_per_shard=s3.count // 8,
                 note="asyncload only (the others read single objects): compare with imagenet-s3-latency"),
        Workload("large-samples", "Large samples: 3.125 ms I/O each, (1000,150) float64, "
                 "0.05 s step per batch", "synthetic", "", 128, 1024, short,
                 step_s=LARGE_STEP_S, budget_s=3 if quick else 6,
                 note="floor: 0.05 s per batch (the simulated step)"),
        Workload("consumer-bound", f"Consumer-bound: {step * 1000:.0f} ms step per batch of "
                 f"{s3_batch} local JPEGs", "local", s3.name, s3_batch, s3.count, 1 if quick else 2, step_s=step, budget_s=3 if quick else 6,
                 note="a good loader keeps the consumer's wait share near 0"),
        Workload("python-step", f"Python-bound step: {PYTHON_STEP_S * 1000:.0f} ms of pure-Python work "
                 f"per batch of {s3_batch} local JPEGs", "local", s3.name, s3_batch, s3.count, 3,
                 step_s=PYTHON_STEP_S, step_kind="python", budget_s=6 if quick else 10,  # a 3 s warm-up
                 # epoch (isolate=True starts its process in it) still leaves room for 2 epochs
                 note="the step holds the GIL; step ms: its time per batch while loading (alone: "
                      "before the loader started and after its epochs, the mean)"),
    ]
