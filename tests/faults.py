"""A TCP proxy in front of the S3 server that misbehaves on purpose: throttling and 5xx answers,
connection resets, stalls, and going away and coming back (a restart, with the data intact,
as a real bucket's data survives an outage).

It runs an event loop on a thread of the test process so a test can change its behaviour while
a loader reads through it. Each client connection carries one request (the S3 server closes
every connection), and ``plan`` decides what happens to it from the request's first line.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from typing import Callable

from tests.support.s3server import free_port, pump

PASS, RESET, STALL = "pass", "reset", "stall"
SLOW_DOWN = (503, "SlowDown", "Please reduce your request rate.")
INTERNAL = (500, "InternalError", "We encountered an internal error. Please try again.")


def error_response(status: int, code: str, message: str) -> bytes:
    body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
            f"<Message>{message}</Message></Error>").encode()
    head = (f"HTTP/1.1 {status} {code}\r\nContent-Type: application/xml\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    return head + body


class FaultProxy:
    """``plan(request_line, count) -> action``: ``PASS``, ``RESET``, ``STALL`` or an
    ``(status, code, message)`` error; ``count`` numbers the requests for that line from 1."""

    def __init__(self, target_port: int, plan: Callable[[str, int], object] | None = None) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.plan = plan or (lambda line, count: PASS)
        self.counts: dict[str, int] = {}
        # A stall holds its request unanswered until the client gives up (closes the connection)
        # or the proxy exits: never answered on a timer of the proxy's own, so the client's timeout
        # fires for certain, however busy the machine.
        self.stalls = 0  # requests stalled so far
        self.stalling = 0  # requests stalled now, their clients still waiting
        self.peak_stalling = 0  # the most stalled at once
        self.stalled = threading.Event()  # set at the first stall
        self.delay_seconds = 0.0  # before each request that passes: a far bucket's first byte
        self._loop = asyncio.new_event_loop()
        self._listener: socket.socket | None = None
        self._connections: dict[asyncio.Future, socket.socket] = {}  # each client's, by its task
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "FaultProxy":
        self._thread.start()
        self.start_listening()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_listening()
        asyncio.run_coroutine_threadsafe(self._cancel_connections(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def start_listening(self) -> None:
        """Accept connections on ``port`` (again)."""
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(timeout=10)

    def stop_listening(self) -> None:
        """Refuse new connections and reset open ones, as a server that died: its kernel closes
        the listening socket and sends RST on every connection, accepted or still in the backlog."""
        if self._listener is not None:
            asyncio.run_coroutine_threadsafe(self._die(), self._loop).result(timeout=10)

    @staticmethod
    async def _cancel_connections() -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _listen(self) -> None:
        # Our own accept loop, not asyncio.start_server: on Python 3.11 a connection accepted just
        # before Server.close() fails its transport's ``assert self._sockets is not None`` and its
        # socket stays open, unread and unanswered, so the client hung for its whole read timeout
        # (60 s), which a server that died never does; and 3.11's Server cannot close its clients.
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(128)
        listener.setblocking(False)
        self._listener = listener
        self._loop.add_reader(listener, self._accept, listener)

    def _accept(self, listener: socket.socket) -> None:
        """Each connection waiting, into a task of its own at once: nothing accepted is ever
        held where ``_die`` cannot reset it (a cancelled ``sock_accept`` could drop one)."""
        while True:
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            conn.setblocking(False)
            task = asyncio.ensure_future(self._serve(conn))
            self._connections[task] = conn
            task.add_done_callback(lambda done: self._connections.pop(done, None))

    async def _serve(self, conn: socket.socket) -> None:
        try:
            reader, writer = await asyncio.open_connection(sock=conn)
        except BaseException:
            conn.close()
            raise
        await self._handle(reader, writer)

    async def _die(self) -> None:
        listener, self._listener = self._listener, None
        self._loop.remove_reader(listener)
        listener.close()  # what is still in its backlog is reset by the kernel
        connections = list(self._connections.items())
        for task, conn in connections:
            if conn.fileno() != -1:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            task.cancel()  # the handler closes its connection: with the linger above, an RST
        await asyncio.gather(*(task for task, _ in connections), return_exceptions=True)
        for _, conn in connections:
            conn.close()  # one whose task was cancelled before it began (a no-op for the rest)

    async def _handle(self, client_reader, client_writer) -> None:
        try:
            first = await client_reader.read(65536)
            line = first.split(b"\r\n", 1)[0].decode(errors="replace")
            self.counts[line] = self.counts.get(line, 0) + 1
            action = self.plan(line, self.counts[line])
            if action == RESET:
                _reset(client_writer)
                return
            if action == STALL:
                await self._stall(client_reader)
            elif action != PASS:
                client_writer.write(error_response(*action))
                await client_writer.drain()
            else:
                await asyncio.sleep(self.delay_seconds)
                await self._forward(first, client_reader, client_writer)
        except (ConnectionError, OSError, asyncio.CancelledError):
            pass
        finally:
            client_writer.close()

    async def _stall(self, client_reader) -> None:
        """Holds the request until its client closes the connection (EOF or a reset) or the proxy
        exits (cancelled); counts it, and how many are held at once."""
        self.stalls += 1
        self.stalling += 1
        self.peak_stalling = max(self.peak_stalling, self.stalling)
        self.stalled.set()
        try:
            while await client_reader.read(65536):
                pass
        finally:
            self.stalling -= 1

    async def _forward(self, first: bytes, client_reader, client_writer) -> None:
        server_reader, server_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        server_writer.write(first)
        await asyncio.gather(pump(client_reader, server_writer), pump(server_reader, client_writer))


def _reset(writer) -> None:
    """Close with RST instead of FIN: what a peer's crash or a middlebox looks like."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def first_tries(action, tries: int = 1):
    """A plan: ``action`` for the first ``tries`` GETs of every object, then pass."""

    def plan(line: str, count: int):
        return action if line.startswith("GET ") and "/asyncload-test/" in line and count <= tries else PASS

    return plan
