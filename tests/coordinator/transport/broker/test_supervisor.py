"""The broker supervisor: a crashed broker is reaped, reported and restarted; a stale one is ended."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.transport.broker import pidfile
from coordinator.transport.broker.base import BrokerError, BrokerSettings, probe
from coordinator.transport.broker.credentials import generate_credentials
from coordinator.transport.broker.mosquitto import MosquittoBroker, find_mosquitto
from coordinator.transport.broker.scratch import scratch_dir
from coordinator.transport.broker.supervisor import BrokerSupervisor

pytestmark = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")


def make_broker(port: int = 0) -> MosquittoBroker:
    return MosquittoBroker(
        BrokerSettings("sv", scratch_dir("fedfleet-broker-"), generate_credentials(["d0"]), port=port)
    )


@pytest.fixture
def supervised(tmp_path: Path) -> Iterator[BrokerSupervisor]:
    supervisor = BrokerSupervisor(make_broker(), tmp_path / "broker.pid", max_restarts=1, interval_s=0.1)
    supervisor.start(timeout=60)
    yield supervisor
    supervisor.stop()


def wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_killed_broker_is_reaped_reported_and_restarted_on_its_port(
    supervised: BrokerSupervisor, caplog: pytest.LogCaptureFixture
) -> None:
    first = supervised.broker.process
    assert pidfile.live_owner(supervised.pid_file) == first.pid

    with caplog.at_level("WARNING"):
        os.kill(first.pid, signal.SIGKILL)
        # The last thing the supervisor does for a restart is log it: wait for that, not for the pid file before it.
        wait_for(lambda: "broker restarted (restart 1 of at most 1)" in caplog.text)

    assert first.returncode == -signal.SIGKILL  # reaped: no zombie left behind
    assert pidfile.live_owner(supervised.pid_file) == supervised.broker.process.pid
    assert probe(supervised.broker.address, 30) == "ok"
    assert f"the broker (pid {first.pid}) was killed by SIGKILL; restarting it on the same port" in caplog.text
    assert "broker restarted (restart 1 of at most 1)" in caplog.text


def test_restarts_are_bounded_and_the_coordinator_is_told(supervised: BrokerSupervisor) -> None:
    reasons: list[str] = []
    supervised.on_give_up = reasons.append
    killed: list[int] = []
    for _ in range(2):
        wait_for(lambda: pidfile.live_owner(supervised.pid_file) not in (None, *killed))
        killed.append(supervised.broker.process.pid)
        os.kill(killed[-1], signal.SIGKILL)

    wait_for(lambda: reasons)
    assert "1 restarts within 300 s did not keep it up; giving up" in reasons[0]
    assert supervised.failure == reasons[0]


def test_a_broker_left_by_a_killed_coordinator_is_ended_before_ours_starts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    stale = make_broker()
    stale.start()
    pidfile.record(tmp_path / "broker.pid", stale.process.pid)

    supervisor = BrokerSupervisor(make_broker(port=stale.port), tmp_path / "broker.pid")
    with caplog.at_level("WARNING"):
        supervisor.start()  # would fail with "port ... is taken" had the stale broker kept running
    try:
        assert stale.process.poll() is not None
        assert probe(supervisor.broker.address, 30) == "ok"
        assert f"stopping the broker (pid {stale.process.pid}) an earlier coordinator" in caplog.text
    finally:
        supervisor.stop()
    assert not (tmp_path / "broker.pid").exists()


def test_a_pid_file_naming_another_program_is_refused_clearly(tmp_path: Path) -> None:
    pidfile.record(tmp_path / "broker.pid", os.getpid())

    with pytest.raises(BrokerError, match=r"names pid \d+, which runs .*python.*not a broker; remove the file"):
        BrokerSupervisor(make_broker(), tmp_path / "broker.pid").start()
