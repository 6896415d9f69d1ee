"""The launcher starts real processes, reports the ones that die, and always stops the rest."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

from device_agent.emulation.launcher import AgentExit, AgentGroup, AgentSpec

# A stand-in for `device-agent run`: behaves as its config file says, so the test needs no broker.
_FAKE_AGENT = """
import os, signal, sys, time
mode = open(sys.argv[1]).read().strip()
print("started", os.environ["FEDFLEET_PASSWORD"], os.environ["OMP_NUM_THREADS"], flush=True)
if mode == "crash":
    print("boom: out of something", flush=True)
    sys.exit(3)
if mode == "stubborn":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
try:
    while True:
        time.sleep(0.05)
except KeyboardInterrupt:
    print("clean shutdown", flush=True)
"""


def _command(config: Path) -> list[str]:
    return [sys.executable, "-c", _FAKE_AGENT, str(config)]


def _spec(tmp_path: Path, device: str, mode: str) -> AgentSpec:
    config = tmp_path / f"{device}.yaml"
    config.write_text(mode)
    return AgentSpec(device, config, tmp_path / device / "agent.log", threads=2, env={"FEDFLEET_PASSWORD": device})


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_for(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.slow
def test_crash_is_reported_with_its_log_and_the_rest_stop_cleanly(tmp_path: Path) -> None:
    exits: list[AgentExit] = []
    reported = threading.Event()

    def on_exit(exit_: AgentExit) -> None:
        exits.append(exit_)
        reported.set()

    with AgentGroup(_command) as agents:
        modes = {"a": "run", "b": "crash", "c": "run"}
        pids = [agents.start(_spec(tmp_path, name, mode)) for name, mode in modes.items()]
        agents.watch(on_exit, interval=0.05)
        assert reported.wait(60)
        assert [e.device for e in exits] == ["b"]
        assert exits[0].crashed and exits[0].returncode == 3
        assert "boom: out of something" in exits[0].tail
        assert "agent b exited (exit code 3)" in exits[0].describe()
        _wait_for(lambda: all("started" in (tmp_path / d / "agent.log").read_text() for d in "ac"))
        assert sorted(agents.running()) == ["a", "c"]
        assert agents.stop(timeout=10) == []
    assert not any(_alive(pid) for pid in pids)
    assert agents.killed == []
    for device in "ac":
        log = (tmp_path / device / "agent.log").read_text()
        assert f"started {device} 2" in log  # its own password and thread count reached it
        assert "clean shutdown" in log  # SIGINT, not a kill
    assert len(exits) == 1  # stopping is not reported as a crash


@pytest.mark.slow
def test_an_agent_that_ignores_sigint_is_killed(tmp_path: Path) -> None:
    agents = AgentGroup(_command)
    pid = agents.start(_spec(tmp_path, "s", "stubborn"))
    _wait_for(lambda: "started" in (tmp_path / "s" / "agent.log").read_text())
    agents.stop(timeout=0.5)
    assert agents.killed == ["s"]
    assert not _alive(pid)


def test_a_device_cannot_be_started_twice(tmp_path: Path) -> None:
    with AgentGroup(_command) as agents:
        agents.start(_spec(tmp_path, "a", "run"))
        with pytest.raises(ValueError, match="already running"):
            agents.start(_spec(tmp_path, "a", "run"))
