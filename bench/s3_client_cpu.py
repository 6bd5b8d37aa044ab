"""Client CPU per S3 GET: s3fs (botocore) against obstore (Rust), side by side in one run.

    python -m bench.s3_client_cpu [--objects 300] [--in-flight 32] [--runs 3]

Starts a local moto server, puts ``--objects`` objects of 100 KB, then fetches them all through
each filesystem's ``_cat_file`` (the call asyncload's reader makes) with ``--in-flight`` GETs
at once, ``--runs`` times, alternating. Reports the median CPU time of this process per GET
(moto runs in its own process and is not counted; obstore's Rust threads are) and the ratio.
moto closes every connection, so each GET also pays for a new connection in both clients.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

from bench.s3server import S3_ENV, MotoServer, obstore_options, storage_options

SIZE = 100_000
BUCKET = "client-cpu"


async def cpu_per_get(fs, paths: list[str], in_flight: int) -> float:
    """Microseconds of this process's CPU per GET, fetching every path once."""
    slots = asyncio.Semaphore(in_flight)

    async def get(path: str) -> int:
        async with slots:
            return len(await fs._cat_file(path))

    started = time.process_time()
    sizes = await asyncio.gather(*(get(p) for p in paths))
    assert sizes == [SIZE] * len(paths)
    return (time.process_time() - started) / len(paths) * 1e6


async def compare(endpoint_url: str, paths: list[str], in_flight: int, runs: int) -> dict[str, float]:
    import s3fs
    from obstore.fsspec import FsspecStore

    loop = asyncio.get_running_loop()
    clients = {
        "s3fs": s3fs.S3FileSystem(asynchronous=True, loop=loop, skip_instance_cache=True,
                                  **storage_options(endpoint_url), config_kwargs={"max_pool_connections": in_flight}),
        "obstore": FsspecStore("s3", asynchronous=True, loop=loop, skip_instance_cache=True,
                               **obstore_options(endpoint_url)),
    }
    await clients["s3fs"].set_session()
    figures: dict[str, list[float]] = {name: [] for name in clients}
    for _ in range(runs):
        for name, fs in clients.items():
            figures[name].append(await cpu_per_get(fs, paths, in_flight))
    await clients["s3fs"]._s3creator.__aexit__(None, None, None)
    return {name: statistics.median(values) for name, values in figures.items()}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.s3_client_cpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--objects", type=int, default=300)
    parser.add_argument("--in-flight", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    os.environ.update(S3_ENV)
    import s3fs

    with MotoServer() as server:
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **storage_options(server.endpoint_url))
        fs.mkdir(BUCKET)
        paths = [f"{BUCKET}/object-{i:05d}" for i in range(args.objects)]
        fs.pipe({path: os.urandom(SIZE) for path in paths})
        result = asyncio.run(compare(server.endpoint_url, paths, args.in_flight, args.runs))
    print(f"client CPU per GET of {SIZE // 1000} KB, {args.in_flight} in flight, median of {args.runs} runs:")
    for name, micros in result.items():
        print(f"  {name:<8} {micros / 1000:6.2f} ms")
    print(f"  s3fs / obstore: {result['s3fs'] / result['obstore']:.1f}x")


if __name__ == "__main__":
    main()
