"""A bug in a client program fails the round, not the agent: the same process trains the next round.

A real ``coordinator start`` process and a real agent process (``tests.e2e.agent_with_program_bug``:
``run_agent`` with every client program raising ``TypeError`` in its first round) meet on the
mosquitto the tests start. Before the fix the TypeError escaped the agent's main loop and killed
the process; under systemd (``Restart=on-failure``) the re-sent assignment killed it again until
the round's deadline.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.coordinator.one_device_fleet import coordinator_command, device_settings, one_device_fleet
from tests.paths import REPO_ROOT
from tests.processes import stop_processes
from tests.program_bugs import BUG
from tests.transport_fixtures import TestBroker

pytestmark = pytest.mark.slow

DEVICE = "dev-a"


def test_a_program_raising_type_error_fails_its_round_and_the_agent_trains_the_next(
    fresh_mosquitto: TestBroker, tmp_path: Path
) -> None:
    fleet = one_device_fleet(tmp_path, fresh_mosquitto, DEVICE)
    run_dir = tmp_path / "run"
    agent_yaml = tmp_path / "agent.yaml"
    agent_yaml.write_text(yaml.safe_dump(device_settings(tmp_path, fresh_mosquitto, DEVICE)))
    coordinator_log, agent_log = tmp_path / "coordinator.log", tmp_path / "agent.log"
    command = coordinator_command(fleet, run_dir)
    coordinator = subprocess.Popen(command, cwd=REPO_ROOT, stdout=coordinator_log.open("wb"), stderr=subprocess.STDOUT)
    agent = subprocess.Popen(
        [sys.executable, "-m", "tests.e2e.agent_with_program_bug", str(agent_yaml)],
        cwd=REPO_ROOT,
        stdout=agent_log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 240
        while coordinator.poll() is None and agent.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        agent_exit = agent.poll()
        assert agent_exit is None, f"the agent process exited ({agent_exit}):\n{agent_log.read_text()[-3000:]}"
        # Round 1 aggregated nothing (its one update failed): the run says so and exits 1 (issue [guard]).
        assert coordinator.returncode == 1, coordinator_log.read_text()[-3000:]
        assert "1 of 2 rounds failed" in coordinator_log.read_text()
    finally:
        stop_processes((agent, coordinator))

    rounds = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first, second = (r["devices"][DEVICE] for r in rounds)
    assert first["status"] == "failed", first
    assert first["error"] == f"error: TypeError: {BUG}", first
    assert second["status"] == "accepted", second
    assert f"TypeError: {BUG}" in agent_log.read_text()  # the device's log keeps the traceback for its owner
