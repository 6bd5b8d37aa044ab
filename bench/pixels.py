"""What torchvision's pixels cost: decode + resize per image, the antialiased default against the
fast OpenCV path, and how far each is from torchvision on real photos in every encoding.

    python -m bench.pixels [--images 64] [--rounds 7] [--device cuda]

Timing: the benchmark's images (bench/harness/dataset.py: 500x375, quality 90, ~100 KB) encoded in memory,
decoded on one thread by each path in turn, image after image (the paths alternate, so a noisy
neighbour slows both alike), with OpenCV and torch at one thread each, as in the loader's decode
threads. The cost is counted in process CPU time per image: with every core decoding, throughput
is its inverse, and unlike wall time it does not move when other processes take the cores (the
wall figures are printed too). The median round is reported, and the CPU time per wall second
while the default ran (at most 1.0 when the resize starts no thread of its own).
Parity: the mean absolute difference to PIL's result (torchvision's, with a PIL image) on the
photos scikit-learn and matplotlib ship, in tests/photos.py's encodings.
With ``--device cuda``: GpuImageDecoder's throughput at batch 64 and 256.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import simplejpeg

from asyncload.decode.image import ImageDecoder
from bench.harness.dataset import synth_image
from bench.harness.machine import cpu_model

PATHS = {"fast (cv2, antialias=False)": {"antialias": False}, "default (antialiased)": {}}


def timed_round(decoders: list[ImageDecoder], images: list[bytes], epoch: int) -> list[tuple[float, float]]:
    """Seconds of wall and of process CPU per image for each decoder, decoding every image once
    into one row. The decoders take turns image by image, in an order that alternates, so that a
    burst of load from other processes falls on all of them alike."""
    out = np.empty(decoders[0].field.shape, np.uint8)
    totals = [[0.0, 0.0] for _ in decoders]
    for index, data in enumerate(images):
        order = range(len(decoders)) if index % 2 == 0 else reversed(range(len(decoders)))
        for which in order:
            wall, cpu = time.perf_counter(), time.process_time()
            decoders[which].decode_into(data, out, (epoch, index))
            totals[which][0] += time.perf_counter() - wall
            totals[which][1] += time.process_time() - cpu
    return [(wall / len(images), cpu / len(images)) for wall, cpu in totals]


def throughput(images: list[bytes], rounds: int) -> None:
    print(f"decode + resize of {len(images)} images 500x375 q90 -> 224x224, one thread, median of {rounds} rounds")
    decode_only = statistics.median(_decode_times(images))
    print(f"  JPEG decode alone (simplejpeg, full size): {decode_only * 1e3:.3f} ms/image (CPU)")
    for train in (False, True):
        walls: dict[str, list[float]] = {name: [] for name in PATHS}
        cpus: dict[str, list[float]] = {name: [] for name in PATHS}
        decoders = [ImageDecoder(224, train=train, **options) for options in PATHS.values()]
        for epoch in range(rounds):
            for name, (wall, cpu) in zip(PATHS, timed_round(decoders, images, epoch)):
                walls[name].append(wall)
                cpus[name].append(cpu)
        fast, default = (statistics.median(cpus[name]) for name in PATHS)
        fast_wall, default_wall = (statistics.median(walls[name]) for name in PATHS)
        share = statistics.median(c / w for c, w in zip(cpus["default (antialiased)"], walls["default (antialiased)"]))
        mode = "train (random-resized-crop + flip)" if train else "eval (resize + centre crop)"
        print(f"  {mode}: CPU fast {fast * 1e3:.3f} ms, default {default * 1e3:.3f} ms/image; "
              f"throughput default/fast = {fast / default:.3f} (cost {1 - fast / default:+.1%}); "
              f"wall {fast_wall * 1e3:.3f} / {default_wall * 1e3:.3f} ms; CPU/wall of default: {share:.2f}")


def large_photos(rounds: int) -> None:
    """Photos 3x the size of the shipped ones (~2.5 MP): between a 2x and an 8x shrink the fast
    path decodes at a reduced DCT scale and the default, for its pixels, does not."""
    from PIL import Image

    from tests.photos import photos

    print("eval of ~2.5 MP photos (the shipped ones, upscaled 3x with Lanczos), CPU ms/image:")
    for name, photo in photos().items():
        big = Image.fromarray(photo).resize((photo.shape[1] * 3, photo.shape[0] * 3), Image.LANCZOS)
        data = simplejpeg.encode_jpeg(np.asarray(big), quality=90)
        decoders = [ImageDecoder(224, **options) for options in PATHS.values()]
        cpus = list(zip(*(timed_round(decoders, [data] * 4, epoch) for epoch in range(rounds))))
        fast, default = (statistics.median(cpu for _, cpu in runs) for runs in cpus)
        print(f"  {name} {big.height}x{big.width}: fast {fast * 1e3:.2f}, default {default * 1e3:.2f} "
              f"(throughput default/fast = {fast / default:.2f})")


def _decode_times(images: list[bytes]) -> list[float]:
    times = []
    for data in images:
        start = time.process_time()
        simplejpeg.decode_jpeg(data, colorspace="RGB", strict=True)
        times.append(time.process_time() - start)
    return times


def parity() -> None:
    from tests.photos import VARIANTS, encoded, mean_abs_diff, photos, reference_crop, reference_eval

    print("mean |difference| to torchvision's pixels (PIL), grey levels, 224x224:")
    print(f"  {'photo':<13} {'variant':<17} {'eval default':>12} {'eval fast':>10} {'train default':>14} {'train fast':>11}")
    for photo in photos():
        height, width = photos()[photo].shape[:2]
        for variant in VARIANTS:
            data = encoded(photo, variant)
            reference = reference_eval(data, 224)
            row = [mean_abs_diff(ImageDecoder(224, antialias=aa)(data), reference) for aa in (True, False)]
            for antialias in (True, False):
                decoder = ImageDecoder(224, train=True, antialias=antialias)
                diffs = []
                for index in range(4):
                    plan = decoder.plan(height, width, decoder.rng((0, index)), reducible=False)
                    # the fast path draws the same box; it is snapped only past an 8x shrink
                    expected = reference_crop(data, plan.box, 224, plan.flip)
                    diffs.append(mean_abs_diff(decoder(data, key=(0, index)), expected))
                row.append(float(np.mean(diffs)))
            print(f"  {photo:<13} {variant:<17} {row[0]:>12.2f} {row[1]:>10.2f} {row[2]:>14.2f} {row[3]:>11.2f}")


def gpu(images: list[bytes], device: str) -> None:
    """GpuImageDecoder's throughput (every row on the decoder, nvImageCodec); on "cpu" through its
    CPU backend: a check of this code, not a measurement of a GPU."""
    import torch

    from asyncload.decode.gpu import GpuImageDecoder

    on_cuda = device.startswith("cuda")
    name = torch.cuda.get_device_name(device) if on_cuda else "cpu, nvImageCodec's CPU backend"
    sync = (lambda: torch.cuda.synchronize(device)) if on_cuda else (lambda: None)
    print(f"GpuImageDecoder on {name}, 500x375 q90 JPEGs -> 224x224:")
    for batch in (64, 256):
        for train in (False, True):
            decoder = GpuImageDecoder(224, train=train, device=device)
            data = (images * (batch // len(images) + 1))[:batch]
            out = torch.empty((batch, 224, 224, 3), dtype=torch.uint8, device=device)
            decoder.decode_batch(data, [(0, i) for i in range(batch)], out)  # warm-up
            sync()
            rounds, start, cpu = 5, time.perf_counter(), time.process_time()
            for epoch in range(1, rounds + 1):
                decoder.decode_batch(data, [(epoch, i) for i in range(batch)], out)
            sync()
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            print(f"  batch {batch} {'train' if train else 'eval'}: {rounds * batch / wall:,.0f} img/s, "
                  f"host CPU {cpu / (rounds * batch) * 1e3:.3f} ms/image")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--device", default="cpu", help="cuda: also time GpuImageDecoder; cpu-batch: run its code on the CPU")
    parser.add_argument("--skip-parity", action="store_true")
    args = parser.parse_args()
    import cv2
    import PIL
    import torch

    print(f"machine: {cpu_model()}, {len(__import__('os').sched_getaffinity(0))} cores; torch {torch.__version__}, "
          f"opencv {cv2.__version__}, simplejpeg {simplejpeg.__version__}, pillow {PIL.__version__}")
    cv2.setNumThreads(1)
    torch.set_num_threads(1)
    images = [simplejpeg.encode_jpeg(synth_image(0, i), quality=90) for i in range(args.images)]
    throughput(images, args.rounds)
    large_photos(args.rounds)
    if not args.skip_parity:
        parity()
    if args.device.startswith("cuda") or args.device == "cpu-batch":
        gpu(images, args.device.replace("cpu-batch", "cpu"))


if __name__ == "__main__":
    main()
