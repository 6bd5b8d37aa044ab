"""Client CPU per S3 GET: obstore (asyncload's default) against s3fs, side by side in one run.

    python -m bench.s3_client_cpu [--objects 1000] [--in-flight 32] [--runs 3] [--endpoint URL] [--json]

Starts SeaweedFS (or uses the S3 server at ``--endpoint``, which must allow any key), puts
``--objects`` objects of 100 KB, then fetches them all through each client as asyncload's reader
builds it (``asyncload.object_store.filesystem``, the same fsspec-style options, the same read)
with ``--in-flight`` GETs at once, ``--runs`` times, alternating. Reports the median CPU time of
this process per GET (the server runs in its own process and is not counted; obstore's Rust
threads are) and GETs/s. SeaweedFS keeps connections alive, as a cloud bucket does, so a GET
pays for no new connection. ``python -m bench`` runs this too and puts the result in its JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import time

from tests.support.s3server import SeaweedFS, storage_options

SIZE = 100_000
BUCKET = "client-cpu"
CLIENTS = ("obstore", "fsspec")  # storage_options["client"]: fsspec is s3fs here


async def cpu_per_get(fs, paths: list[str], in_flight: int) -> tuple[float, float]:
    """(milliseconds of this process's CPU per GET, GETs per second), fetching every path once
    as asyncload's reader does (``one_request_read``: obstore's one ranged GET, s3fs's ``_cat_file``
    without a HEAD first)."""
    slots = asyncio.Semaphore(in_flight)
    from asyncload.io.reader import one_request_read

    cat = one_request_read(fs)

    async def get(path: str) -> int:
        async with slots:
            return len(await cat(fs._strip_protocol(path)))

    cpu, wall = time.process_time(), time.perf_counter()
    sizes = await asyncio.gather(*(get(p) for p in paths))
    assert sizes == [SIZE] * len(paths)
    return (time.process_time() - cpu) / len(paths) * 1e3, len(paths) / (time.perf_counter() - wall)


async def compare(endpoint_url: str, paths: list[str], in_flight: int, runs: int) -> dict[str, dict[str, float]]:
    from asyncload.io import object_store

    loop = asyncio.get_running_loop()
    clients = {name: object_store.filesystem("s3", {**storage_options(endpoint_url), "client": name}, loop=loop,
                                             read_timeout=60.0, connections=in_flight) for name in CLIENTS}
    figures: dict[str, list[tuple[float, float]]] = {name: [] for name in clients}
    try:
        for name, fs in clients.items():  # a first pass opens the connections
            await cpu_per_get(fs, paths[:in_flight], in_flight)
        for _ in range(runs):
            for name, fs in clients.items():
                figures[name].append(await cpu_per_get(fs, [f"s3://{p}" for p in paths], in_flight))
    finally:
        for fs in clients.values():
            await object_store.close_sessions(fs)
    return {("s3fs" if name == "fsspec" else name): {
        "cpu_ms_per_get": statistics.median(cpu for cpu, _ in values),
        "gets_per_s": statistics.median(rate for _, rate in values)} for name, values in figures.items()}


def measure(endpoint_url: str | None = None, objects: int = 1000, in_flight: int = 32, runs: int = 3,
            bucket: str = BUCKET) -> dict:
    """Puts the objects in ``bucket`` on ``endpoint_url`` (a fresh SeaweedFS when None) and
    compares the clients."""
    import s3fs

    with contextlib.ExitStack() as stack:
        if endpoint_url is None:
            endpoint_url = stack.enter_context(SeaweedFS()).endpoint_url
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **storage_options(endpoint_url))
        if not fs.exists(bucket):
            fs.mkdir(bucket)
        paths = [f"{bucket}/client-cpu/object-{i:05d}" for i in range(objects)]
        data = {path: os.urandom(SIZE) for path in paths}
        for attempt in range(3):  # a new bucket's first writes can meet a 500 while its volumes grow
            try:
                fs.pipe(data, batch_size=32)
                break
            except OSError:
                if attempt == 2:
                    raise
                time.sleep(1)
        result = asyncio.run(compare(endpoint_url, paths, in_flight, runs))
    return {"object_bytes": SIZE, "objects": objects, "in_flight": in_flight, "runs": runs, **result,
            "s3fs_over_obstore": result["s3fs"]["cpu_ms_per_get"] / result["obstore"]["cpu_ms_per_get"]}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.s3_client_cpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--objects", type=int, default=1000)
    parser.add_argument("--in-flight", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--endpoint", default=None, help="an S3 server already running (default: start SeaweedFS)")
    parser.add_argument("--bucket", default=BUCKET, help="an existing bucket spares SeaweedFS growing volumes "
                        "for a new one, which can fail its first writes on a busy machine")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    result = measure(args.endpoint, args.objects, args.in_flight, args.runs, args.bucket)
    if args.json:
        print(json.dumps(result))
        return
    print(f"client CPU per GET of {SIZE // 1000} KB, {args.in_flight} in flight, median of {args.runs} runs:")
    for name in ("obstore", "s3fs"):
        print(f"  {name:<8} {result[name]['cpu_ms_per_get']:6.2f} ms   {result[name]['gets_per_s']:7,.0f} GETs/s")
    print(f"  s3fs / obstore: {result['s3fs_over_obstore']:.1f}x")


if __name__ == "__main__":
    main()
