"""Differential privacy end to end: `coordinator emulate --fleet examples/private.yaml`, real agents and mosquitto.

The devices clip on the device, the coordinator noises the sum and accounts each round; the budget lets two of the
three configured rounds run, and the run stops before round 3 with its report and exit code 3.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from coordinator.cli.start import EXIT_PRIVACY_BUDGET
from coordinator.privacy.accountant import planned_epsilon
from coordinator.run.rundir import read_metrics
from coordinator.transport.broker.base import free_port
from coordinator.transport.broker.mosquitto import find_mosquitto
from tests.paths import REPO_ROOT

EXAMPLE = REPO_ROOT / "examples" / "private.yaml"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed"),
]


def test_a_private_fleet_reports_epsilon_per_round_and_stops_at_its_budget(tmp_path: Path) -> None:
    fleet = yaml.safe_load(EXAMPLE.read_text())
    fleet["transport"]["broker"]["port"] = free_port()
    fleet_file = tmp_path / "fleet.yaml"
    fleet_file.write_text(yaml.safe_dump(fleet, sort_keys=False))
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "coordinator", "emulate", "--fleet", str(fleet_file), "--run-dir", str(run_dir)]
    done = subprocess.run([*command, "--no-live"], capture_output=True, text=True, timeout=240, cwd=REPO_ROOT)

    assert done.returncode == EXIT_PRIVACY_BUDGET, done.stdout[-3000:] + done.stderr[-3000:]
    assert "coordinator: stopped: privacy budget: round 3 would take epsilon from 7.077 to 9.010" in done.stderr
    rounds = read_metrics(run_dir / "metrics.jsonl")
    z, delta = fleet["privacy"]["noise_multiplier"], fleet["privacy"]["delta"]
    assert [m.round for m in rounds] == [1, 2]
    assert [m.privacy.epsilon for m in rounds] == pytest.approx([planned_epsilon(4, 4, r, z, delta) for r in (1, 2)])
    assert all(m.participants == 4 for m in rounds)  # every clipped upload passed the coordinator's clip check
    assert "epsilon" in (run_dir / "report.html").read_text()
