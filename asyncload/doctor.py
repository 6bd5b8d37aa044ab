"""``python -m asyncload.doctor URL``: the one command to run when training is slow.

It loads the source at ``URL`` (a folder or bucket prefix of class folders, a tar shard set, or
a manifest file) with the loader's settings for about ``--seconds``, as fast as the loader can
(no training step: what it measures is the loader's ceiling), then prints what each stage cost,
what limits the loader (the stats' verdict, with its evidence), the setting to try next, and
where the trace of the run was written (a timeline to open in Perfetto or chrome://tracing).

    python -m asyncload.doctor s3://bucket/train --options s3.json
    ASYNCLOAD_STORAGE_OPTIONS='{"endpoint_url": "..."}' python -m asyncload.doctor s3://bucket/train
    python -m asyncload.doctor /data/shards --processes 2 --seconds 30

Storage options (fsspec-style, as ``storage_options=``) come from the JSON in
``ASYNCLOAD_STORAGE_OPTIONS``, then the JSON file ``--options``, then ``--storage-options`` on the
command line, which takes no credentials (``ps`` and the shell's history show a command line): a
secret there is refused. The clients also read their own variables (``AWS_ACCESS_KEY_ID``, ...).
A source or storage that fails gives one line and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import TYPE_CHECKING, Any, Sequence

from .errors import StorageError, describe
from .sources.items import image_folder, manifest
from .sources.shards import tar_shards
from .redact import bounded, is_secret_name, redact_options
from .stats.machine import usable_cores
from .stats.verdict import diagnose

if TYPE_CHECKING:
    from .loader import AsyncLoader

MANIFEST_SUFFIXES = (".txt", ".csv", ".lst")
OPTIONS_VARIABLE = "ASYNCLOAD_STORAGE_OPTIONS"
NOT_SECRETS = (None, True, False, "", "anon", "google_default", "cloud", "browser", "cache")  # gcsfs's token modes


class Refused(ValueError):
    """Options the doctor will not take as given (their message says why and what to do)."""


def storage_options(args: argparse.Namespace, environ: dict[str, str]) -> tuple[dict[str, Any] | None, list[str]]:
    """The storage options from ``ASYNCLOAD_STORAGE_OPTIONS``, the ``--options`` file and
    ``--storage-options``, later ones winning key by key, and where they came from; a secret on
    the command line is refused."""
    options: dict[str, Any] = {}
    origins = []
    for where, text in ((f"${OPTIONS_VARIABLE}", environ.get(OPTIONS_VARIABLE)),
                        (f"--options {args.options}", _read(args.options) if args.options else None),
                        ("--storage-options", args.storage_options)):
        if not text:
            continue
        try:
            given = json.loads(text)
        except json.JSONDecodeError as error:  # its message quotes no value
            raise Refused(f"{where} is not JSON ({error})") from None
        if not isinstance(given, dict):
            raise Refused(f"{where} must be a JSON object of storage options")
        secrets = _secrets(given)
        if where == "--storage-options" and secrets:
            raise Refused(f"--storage-options may not hold {', '.join(secrets)} (a command line shows in ps and "
                          f"the shell's history): put them in --options FILE or ${OPTIONS_VARIABLE}")
        options.update(given)
        origins.append(where)
    return options or None, origins


def _read(path: str) -> str:
    try:
        with open(path) as file:
            return file.read()
    except OSError as error:
        raise Refused(f"--options {path}: {describe(error)}") from None


def _secrets(options: dict[str, Any]) -> list[str]:
    """The secret-named keys of ``options`` and of the dicts in it (client_kwargs, config, ...)
    whose values are more than a switch (gcsfs's ``token="anon"`` is none)."""
    found = []
    for key, value in options.items():
        if is_secret_name(key) and value not in NOT_SECRETS:
            found.append(str(key))
        elif isinstance(value, dict):
            found += _secrets(value)
    return sorted(found)


def open_source(url: str, storage_options: dict[str, Any] | None) -> Sequence[Any]:
    """What ``url`` names: a shard set (its index, or a folder that holds one), a manifest, or
    class folders of images."""
    if url.endswith(".json"):
        return tar_shards(url, storage_options=storage_options)
    if url.endswith(MANIFEST_SUFFIXES):
        return manifest(url, storage_options=storage_options)
    try:
        return tar_shards(url, storage_options=storage_options)
    except (FileNotFoundError, StorageError):
        pass  # no index.json there: class folders
    return image_folder(url, storage_options=storage_options)


def suggestion(figures: dict[str, Any], processes: int | None) -> str:
    """The setting to try next for the verdict's bottleneck."""
    name, _ = diagnose(figures)
    processes = (figures.get("processes") or 0) if processes is None else processes
    cores = usable_cores()
    if name == "consumer":
        return "none: the loader is ahead of the loop; the time goes to your training step"
    if name == "GIL":
        return (f"processes={max(2, processes * 2, cores // 3)}: Python under one GIL is the limit; N processes "
                f"have N GILs")
    if name == "storage":
        return (f"io_concurrency={2 * figures['io_concurrency']} (more reads in flight), or tar shards "
                f"(asyncload.write_shards: a ranged read per chunk of samples instead of a request each)")
    if name == "memory":
        return f"prefetch={2 * figures['prefetch']}: the window of batches is full while the stages idle"
    if name.startswith("decode"):
        return ("the cores are: decode runs on every core already; the GPU decode stage (device='cuda' with "
                "asyncload[gpu]) or a smaller decode (fewer pixels) is what is left")
    if name == "mixed":
        return "none stands out: compare the stages in the trace"
    return "none: no batch was delivered"


def examine(loader: AsyncLoader, seconds: float) -> tuple[int, float]:
    """Iterates epochs until ``seconds`` have passed; returns (samples, elapsed s)."""
    samples, epoch, started = 0, 0, time.perf_counter()
    while True:
        loader.set_epoch(epoch)
        before = samples
        for batch in loader:
            samples += len(batch[-1]) if isinstance(batch, (tuple, list)) else len(batch)
            if time.perf_counter() - started >= seconds:
                return samples, time.perf_counter() - started
        if samples == before:  # every sample failed (skipped), or none to load: no use going round
            return samples, time.perf_counter() - started
        epoch += 1


def _processes(asked: int | None, figures: dict[str, Any]) -> str:
    """How many processes ran: as asked, or as the loader chose (its report's last line says why)."""
    if asked is not None:
        return f"{asked} processes"
    return f"processes=None: {figures.get('processes') or 0} child processes at the end"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m asyncload.doctor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url", help="class folders, a tar shard set or a manifest (local path or bucket URL)")
    parser.add_argument("--seconds", type=float, default=20.0, help="how long to load (default 20)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--num-threads", default=None, help="decode threads (default: one per core; or auto)")
    parser.add_argument("--io-concurrency", default=None, help="reads in flight (default 64, 4 for shards; or auto)")
    parser.add_argument("--processes", type=int, default=None,
                        help="child processes running the pipeline (default: the loader decides, as processes=None)")
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument("--options", default=None, metavar="FILE",
                        help=f"storage options as a JSON file (credentials go here or in ${OPTIONS_VARIABLE})")
    parser.add_argument("--storage-options", default=None,
                        help="storage options without credentials, as JSON, e.g. '{\"anon\": true}'")
    parser.add_argument("--trace", default="asyncload-doctor.json", help="where to write the trace")
    return parser.parse_args(argv)


def knob(value: str | None) -> int | str | None:
    return value if value in (None, "auto") else int(value)  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    url = bounded(args.url)
    try:
        options, origins = storage_options(args, dict(os.environ))
        if options:
            print(f"asyncload doctor: storage options from {', '.join(origins)}: {redact_options(options)}", flush=True)
        source = open_source(args.url, options)
        if len(source) == 0:
            raise ValueError(f"no samples found at {url}")
        from .loader import AsyncLoader  # here: torch's import (1.5 s) is not paid by a refused option or a missing source

        with AsyncLoader(source, batch_size=args.batch_size, num_threads=knob(args.num_threads),
                         io_concurrency=knob(args.io_concurrency), prefetch=args.prefetch,
                         storage_options=options, processes=args.processes, on_error="skip",
                         max_failures=len(source), trace=args.trace) as loader:
            print(f"asyncload doctor: {url}: {len(source)} samples; loading for {args.seconds:g} s ...", flush=True)
            samples, elapsed = examine(loader, args.seconds)
        figures = loader.stats.as_dict()
    except Refused as error:
        print(f"asyncload doctor: {error}", file=sys.stderr)
        return 2
    except Exception as error:  # storage, a source, options: one line (redacted), not a traceback
        print(f"asyncload doctor: {describe(error)}", file=sys.stderr)
        return 2
    print(f"{samples} samples in {elapsed:.1f} s: {samples / max(elapsed, 1e-9):.0f} samples/s "
          f"({usable_cores()} cores, {_processes(args.processes, figures)})")
    print(loader.stats.report())
    if loader.stats.failures:
        shown = "; ".join(str(failure) for failure in loader.stats.failures[:3])
        print(f"failed samples: {len(loader.stats.failures)} (skipped), e.g. {shown}")
    print(f"suggested: {suggestion(figures, args.processes)}")
    print(f"trace: {os.path.abspath(args.trace)} (open it in https://ui.perfetto.dev or chrome://tracing)")
    return 0


if __name__ == "__main__":
    # Ends without the interpreter's teardown: after a failed request, the object-store client's
    # native runtime aborted the process at exit now and then (SIGABRT, exit -6, seen under a
    # loaded test run) after the one-line message; everything of ours is closed by now.
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
