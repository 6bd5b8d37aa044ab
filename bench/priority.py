"""Why ``isolate=True`` lowers its process's CPU priority: a Python step next to decoding.

    python -m bench.priority [--rounds 3]

Times a 25 ms pure-Python step (``bench.harness.steps``) alone, then next to another process that
decodes JPEGs on 1 or 2 threads (libjpeg-turbo, as the loader's decode threads do) at
niceness 0, 10 and 19, in rounds so that the machine's drift shows as spread. A separate
process takes the GIL out of the step's way, not the CPU: at equal priority two decode threads
share the step's core; at a lower priority they wait for the cores the step leaves idle.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from bench.harness.steps import calibrate, time_alone

DECODER = r"""
import os, sys, threading
import numpy as np, simplejpeg
os.nice(int(sys.argv[1]))
image = np.random.default_rng(0).integers(0, 255, (375, 500, 3), dtype=np.uint8)
data = simplejpeg.encode_jpeg(image, quality=90)
def decode_forever():
    while True:
        simplejpeg.decode_jpeg(data)
for _ in range(int(sys.argv[2])):
    threading.Thread(target=decode_forever, daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"""

SETTINGS = ((0, 0), (1, 0), (2, 0), (2, 10), (2, 19))  # (decode threads, niceness)


def step_ms(loops: int, steps: int = 20) -> float:
    return 1000 * time_alone(loops, steps)


def next_to_decoding(loops: int, threads: int, niceness: int) -> float:
    if not threads:
        return step_ms(loops)
    decoder = subprocess.Popen([sys.executable, "-c", DECODER, str(niceness), str(threads)],
                               stdout=subprocess.PIPE, text=True)
    try:
        decoder.stdout.readline()
        time.sleep(0.5)  # its threads are decoding
        return step_ms(loops)
    finally:
        decoder.kill()
        decoder.wait()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.priority", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    loops = calibrate(0.025)
    results: dict[tuple[int, int], list[float]] = {setting: [] for setting in SETTINGS}
    for _ in range(args.rounds):
        for threads, niceness in SETTINGS:
            results[(threads, niceness)].append(next_to_decoding(loops, threads, niceness))
    print("| other process | step ms (median of rounds) | rounds |\n|---|---:|---|")
    for (threads, niceness), values in results.items():
        other = "none" if not threads else f"{threads} decode thread{'s' * (threads > 1)}, niceness {niceness}"
        print(f"| {other} | {statistics.median(values):.1f} | {', '.join(f'{v:.1f}' for v in values)} |")


if __name__ == "__main__":
    main()
