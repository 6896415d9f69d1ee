"""A run whose rounds aggregate nothing says which rounds failed and exits non-zero, never "all rounds done".

A real ``coordinator start`` and a real (in-process) agent on the suite's mosquitto; the agent's every
training step runs out of memory (torch's own allocator refusing 1 PiB), so each of the two rounds
closes with 0 accepted updates (``on_quorum_miss: skip``), as a fleet whose every upload fails would.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from device_agent.agent.config import parse_config
from device_agent.agent.hooks import RuntimeHooks
from device_agent.agent.runtime import Agent
from tests.coordinator.one_device_fleet import coordinator_command, device_settings, one_device_fleet, serving
from tests.transport_fixtures import TestBroker

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DEVICE = "dev-a"


class AlwaysOutOfMemory(RuntimeHooks):
    """A device too small for any level it is planned at: every training step fails."""

    @contextmanager
    def step(self) -> Iterator[None]:
        torch.empty(2**50, dtype=torch.uint8)  # 1 PiB: torch's allocator refuses it
        yield


def test_a_run_whose_rounds_aggregate_nothing_exits_non_zero(fresh_mosquitto: TestBroker, tmp_path: Path) -> None:
    fleet = one_device_fleet(tmp_path, fresh_mosquitto, DEVICE)
    run_dir = tmp_path / "run"
    command = coordinator_command(fleet, run_dir)
    coordinator = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    config = parse_config(device_settings(tmp_path, fresh_mosquitto, DEVICE))
    with serving(Agent(config, hooks=AlwaysOutOfMemory()), coordinator):
        out, err = coordinator.communicate(timeout=240)
    assert coordinator.returncode == 1, out[-3000:] + err[-3000:]
    assert "all rounds done" not in out
    assert "coordinator: 2 of 2 rounds failed" in err and "round 1, 2;" in err, err[-3000:]
    rounds = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["participants"] for r in rounds] == [0, 0]
    assert "<td>failed rounds (below quorum)</td><td>1, 2</td>" in (run_dir / "report.html").read_text()
