"""A device whose profile cannot hold its plan runs out of memory packed in a worker exactly as in its own process.

The device's agent.yaml says (``emulation.peak_bytes``) that a round at gamma 1 needs 1.5 GiB while its
profile allows 1 GiB; the planner, which predicts the small CNN far lower, still plans it at gamma 1.
So the first round fails with ``out_of_memory`` and the planner steps the device down to gamma 1/2,
whether the agent runs alone (``device-agent run``, RLIMIT_AS cap) or packed (``device-agent worker``,
memory held by accounting). The agent and the coordinator are real processes on a real mosquitto.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from device_agent.emulation.launcher import write_agent_list
from tests.coordinator.one_device_fleet import one_device_fleet
from tests.paths import REPO_ROOT
from tests.transport_fixtures import TestBroker

pytestmark = pytest.mark.slow

ROOT = REPO_ROOT
DEVICE = "dev-a"
_GIB = 2**30


def _agent_yaml(tmp: Path, broker: TestBroker) -> Path:
    config = {
        "device": DEVICE,
        "fleet": broker.fleet,
        "transport": {"broker": {"url": f"mqtt://127.0.0.1:{broker.address().port}", "password": "env:DEV_A_PASSWORD"}},
        "device_type": "cpu",
        "state_dir": str(tmp / "agent"),
        "emulation": {
            "threads": 1,
            "memory_bytes": _GIB,
            "peak_bytes": {1.0: 3 * _GIB // 2, 0.5: _GIB // 2, 0.25: _GIB // 4},
        },
    }
    path = tmp / "agent.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize("mode", ["process", "packed"])
def test_out_of_memory_then_one_level_lower_in_either_mode(
    fresh_mosquitto: TestBroker, tmp_path: Path, mode: str
) -> None:
    fleet = one_device_fleet(tmp_path, fresh_mosquitto, DEVICE, device_password=False)
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "coordinator", "start", "--fleet", str(fleet), "--run-dir", str(run_dir)]
    command += ["--no-live", "--min-devices", "1", "--wait-timeout", "60"]
    agent_yaml = _agent_yaml(tmp_path, fresh_mosquitto)
    if mode == "process":
        agent = [sys.executable, "-m", "device_agent", "run", "--config", str(agent_yaml)]
    else:
        agent_list = write_agent_list(tmp_path / "worker.yaml", [agent_yaml])
        agent = [sys.executable, "-m", "device_agent", "worker", "--agents", str(agent_list)]
    env = {**os.environ, "DEV_A_PASSWORD": fresh_mosquitto.credentials[DEVICE].password}
    log = tmp_path / "coordinator.log"
    agent_log = tmp_path / "agent.log"
    coordinator = subprocess.Popen(command, cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    device = subprocess.Popen(agent, cwd=ROOT, env=env, stdout=agent_log.open("wb"), stderr=subprocess.STDOUT)
    try:
        coordinator.wait(timeout=180)
    finally:
        device.terminate()
        device.wait(timeout=30)
        if coordinator.poll() is None:
            coordinator.kill()
            coordinator.wait()
    assert coordinator.returncode == 1, (
        log.read_text()[-3000:] + agent_log.read_text()[-3000:]
    )  # round 1 aggregated nothing
    assert "1 of 2 rounds failed" in log.read_text() and "round 1;" in log.read_text()

    rounds = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first, second = (r["devices"][DEVICE] for r in rounds)
    assert (first["status"], first["ratio"]) == ("failed", 1.0), first
    assert first["error"] == (
        "out_of_memory: MemoryCapExceeded: emulated device memory cap exceeded: the profile allows 1024 MiB "
        "(accounting); the round at level 1 needs 1536 MiB (predicted peak)"
    )
    assert (second["status"], second["ratio"]) == ("accepted", 0.5), second
    assert device.returncode == 0, agent_log.read_text()[-3000:]
