"""The observers' HTTP servers drop a connection that sends nothing: slow clients cannot hold every thread."""

from __future__ import annotations

import socket
import time

import pytest

from coordinator.observe.serving import BackgroundServer, ReadOnlyHandler


class _Hello(ReadOnlyHandler):
    def do_GET(self) -> None:
        self.reply(200, b"hi", "text/plain")


def test_an_idle_connection_is_closed_after_the_timeout_and_the_server_still_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_Hello, "timeout", 0.5)
    server = BackgroundServer("test page", "127.0.0.1", 0, _Hello)
    try:
        idle = [socket.create_connection(server.address, timeout=10) for _ in range(20)]
        for sock in idle:
            sock.sendall(b"GET / HTT")  # a slow client's first bytes, then nothing
        started = time.monotonic()
        assert all(sock.recv(1024) == b"" for sock in idle)  # closed by the server, not by our 10 s timeout
        assert time.monotonic() - started < 9
        with socket.create_connection(server.address, timeout=10) as sock:
            sock.sendall(b"GET / HTTP/1.0\r\n\r\n")
            assert sock.recv(1024).startswith(b"HTTP/1.0 200")
    finally:
        for sock in idle:
            sock.close()
        server.stop()


def test_the_default_idle_timeout_is_ten_seconds() -> None:
    assert ReadOnlyHandler.timeout == 10.0
