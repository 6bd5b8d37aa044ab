"""The fault proxy itself: its ``stop_listening`` must look like a server that died, or a test
of a restart measures the proxy (a connection it leaves open and unanswered holds a client for
its whole read timeout, 60 s by default, where a dead server's kernel resets it at once)."""

import socket

import pytest

from tests.faults import STALL, FaultProxy
from tests.support.s3server import free_port


def test_stop_listening_resets_open_connections_and_refuses_new_ones():
    with FaultProxy(free_port(), lambda line, count: STALL) as proxy:
        waiting = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
        with waiting:
            waiting.sendall(b"GET /bucket/key HTTP/1.1\r\n")  # accepted, and held (STALL)
            proxy.stop_listening()
            with pytest.raises(ConnectionResetError):
                waiting.recv(1)  # 5 s at most: a hang fails with socket.timeout, not ConnectionResetError
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", proxy.port), timeout=5).close()
        proxy.start_listening()
        socket.create_connection(("127.0.0.1", proxy.port), timeout=5).close()
