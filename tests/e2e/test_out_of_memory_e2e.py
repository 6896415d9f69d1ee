"""A real (not emulated) device that runs out of memory is planned one rank level lower next round.

A real ``coordinator start`` process and an in-process :class:`~device_agent.agent.runtime.Agent` without an
``emulation:`` section meet on the mosquitto the tests start. The out-of-memory is injected through
the runtime's own step hook (:class:`~device_agent.agent.hooks.RuntimeHooks`, which the runtime calls
around every training step): on the first step the hook asks torch's CPU allocator for 1 PiB, which
it refuses with its genuine ``RuntimeError: DefaultCPUAllocator: can't allocate memory``, raised
inside the training step as a model too big for the device would. The runtime has no test path:
it sees that error as it would on hardware.
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
from tests.paths import REPO_ROOT
from tests.transport_fixtures import TestBroker

pytestmark = pytest.mark.slow

ROOT = REPO_ROOT
DEVICE = "dev-a"


class OutOfMemoryOnce(RuntimeHooks):
    """A device whose first training step needs more memory than it has; later steps fit."""

    def __init__(self) -> None:
        self.failed = False

    @contextmanager
    def step(self) -> Iterator[None]:
        if not self.failed:
            self.failed = True
            torch.empty(2**50, dtype=torch.uint8)  # 1 PiB: torch's allocator refuses it
        yield


def test_a_device_out_of_memory_in_round_1_trains_one_level_lower_in_round_2(
    fresh_mosquitto: TestBroker, tmp_path: Path
) -> None:
    fleet = one_device_fleet(tmp_path, fresh_mosquitto, DEVICE)
    run_dir = tmp_path / "run"
    log = tmp_path / "coordinator.log"
    command = coordinator_command(fleet, run_dir)
    coordinator = subprocess.Popen(command, cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT)

    config = parse_config(device_settings(tmp_path, fresh_mosquitto, DEVICE))
    assert config.emulation is None  # a real device: no emulated memory cap, nothing held to a profile
    with serving(Agent(config, hooks=OutOfMemoryOnce()), coordinator):
        coordinator.wait(timeout=240)
    assert coordinator.returncode == 1, log.read_text()[-3000:]  # round 1 aggregated nothing
    assert "1 of 2 rounds failed" in log.read_text() and "round 1;" in log.read_text()

    rounds = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first, second = (r["devices"][DEVICE] for r in rounds)
    assert (first["status"], first["ratio"]) == ("failed", 1.0), first
    assert first["error"].startswith("out_of_memory: RuntimeError:") and "can't allocate memory" in first["error"]
    assert (second["status"], second["ratio"]) == ("accepted", 0.5), second
