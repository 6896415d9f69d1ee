"""free_port hands out listening ports that clients' outgoing connections cannot take in the meantime."""

from __future__ import annotations

import socket

from coordinator.transport.broker import base
from coordinator.transport.broker.base import ephemeral_ports, free_port


def test_ports_come_from_below_the_ephemeral_range_and_are_bindable() -> None:
    ephemeral = ephemeral_ports()
    for _ in range(50):
        port = free_port()
        assert port not in ephemeral
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_taken_port_is_skipped(monkeypatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        picks = iter([taken, taken, 0])

        class Fixed:
            def randint(self, low: int, high: int) -> int:
                pick = next(picks)
                return pick or low

        monkeypatch.setattr(base.random, "SystemRandom", Fixed)
        monkeypatch.setattr(base, "ephemeral_ports", lambda: range(60000, 60001))
        assert free_port() != taken


def test_an_unreadable_range_falls_back_to_linux_defaults(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(base, "EPHEMERAL_RANGE", tmp_path / "missing")
    assert ephemeral_ports() == range(32768, 61000)
