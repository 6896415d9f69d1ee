"""A broker that cannot be reached is named with its cause, retried with backoff, then given up on."""

from __future__ import annotations

import logging
import socket
import time

import pytest

from device_agent.wire.reachability import wait_for_broker, why_unreachable
from device_agent.wire.session import BrokerAddress, Session, SessionConfig
from tests.waiting import until


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_cause_is_named() -> None:
    port = _closed_port()
    assert why_unreachable("127.0.0.1", port) == f"nothing is listening on 127.0.0.1:{port} (connection refused)"
    assert "does not resolve" in (why_unreachable("broker.nonexistent.invalid", 1883) or "")
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        assert why_unreachable("127.0.0.1", listening.getsockname()[1]) is None


def test_waiting_backs_off_then_gives_up_with_the_cause(caplog: pytest.LogCaptureFixture) -> None:
    port = _closed_port()
    now = [0.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    caplog.set_level(logging.WARNING, logger="fedfleet.wire")
    with pytest.raises(ConnectionError, match=rf"127.0.0.1:{port}: nothing is listening .* gave up after 7 s"):
        wait_for_broker("127.0.0.1", port, give_up_s=10, sleep=sleep, clock=lambda: now[0])

    assert slept == [1.0, 2.0, 4.0]
    assert len(caplog.records) == 3 and "retrying in 1 s" in caplog.records[0].getMessage()


@pytest.mark.slow
def test_a_session_that_cannot_reach_its_broker_says_why_once(caplog: pytest.LogCaptureFixture) -> None:
    port = _closed_port()
    session = Session(SessionConfig("dev-a", BrokerAddress("127.0.0.1", port), reconnect_max_s=1), subscriptions=[])
    caplog.set_level(logging.WARNING, logger="fedfleet.wire")
    session.start(timeout=None)

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if "cannot reach broker" in r.getMessage()]

    try:
        until(said)  # the first failed attempt (late on a loaded host)
        time.sleep(3.5)  # then paho retries about every second: none of them may say it again
    finally:
        session.stop()

    assert said() == [
        f"dev-a: cannot reach broker mqtt://127.0.0.1:{port}: nothing is listening on 127.0.0.1:{port} "
        "(connection refused); retrying"
    ]
