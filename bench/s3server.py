"""A real S3-compatible server on 127.0.0.1 (moto), and a proxy that adds first-byte latency.

Both run as child processes so that neither competes with the loader under test for the GIL.
Used by the benchmark and by the tests' fixtures.

    python -m bench.s3server proxy --listen-port 9001 --target-port 9000 --latency 0.02 0.05
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import time
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
    """s3fs options for a local test server (fixed test credentials, no instance metadata)."""
    return {
        "endpoint_url": endpoint_url,
        "key": S3_ENV["AWS_ACCESS_KEY_ID"],
        "secret": S3_ENV["AWS_SECRET_ACCESS_KEY"],
    }


def obstore_options(endpoint_url: str) -> dict:
    """The same for obstore's filesystem (``obstore.fsspec.register("s3")``): its own names."""
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
        return [sys.executable, "-m", "bench.s3server", "proxy", "--listen-port", str(self.port),
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
