"""A round that closes without a device's update must not cost that device the next round.

The device's round-1 upload is held past the round's deadline (its runtime's ``before_upload``
hook sleeps, as a slow link would), so round 1 closes without it and round 2 opens while the
late transfer is still on its way. The late update is answered ``late`` and dropped; round 2's
assignment must still reach the device, and its round-2 update must be accepted.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from device_agent.agent.config import parse_config
from device_agent.agent.hooks import RuntimeHooks
from device_agent.agent.runtime import Agent
from tests.coordinator.one_device_fleet import coordinator_command, device_settings, one_device_fleet, serving
from tests.paths import REPO_ROOT
from tests.transport_fixtures import TestBroker

pytestmark = pytest.mark.slow

DEVICE = "dev-a"
DEADLINE_S = 10


class LateOnce(RuntimeHooks):
    """The first upload leaves well after the round's deadline; later ones at once."""

    def __init__(self) -> None:
        self.uploads = 0

    def before_upload(self) -> None:
        self.uploads += 1
        if self.uploads == 1:
            time.sleep(DEADLINE_S + 1)


def test_a_late_upload_does_not_block_the_next_rounds_assignment(fresh_mosquitto: TestBroker, tmp_path: Path) -> None:
    fleet = one_device_fleet(tmp_path, fresh_mosquitto, DEVICE)
    fleet.write_text(fleet.read_text().replace("round_deadline_s: 60", f"round_deadline_s: {DEADLINE_S}"))
    run_dir = tmp_path / "run"
    log = tmp_path / "coordinator.log"
    command = coordinator_command(fleet, run_dir)
    coordinator = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    config = parse_config(device_settings(tmp_path, fresh_mosquitto, DEVICE))
    with serving(Agent(config, hooks=LateOnce()), coordinator):
        coordinator.wait(timeout=120)
    output = log.read_text()
    rounds = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first, second = (r["devices"][DEVICE]["status"] for r in rounds)
    assert first != "accepted", output[-3000:]
    assert second == "accepted", output[-3000:]
