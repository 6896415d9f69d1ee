"""A fleet.yaml of one x86 laptop on the suite's mosquitto, planned over gamma 1, 1/2 and 1/4."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from coordinator.transport.broker.credentials import COORDINATOR_USER
from device_agent.agent.runtime import Agent
from tests.transport_fixtures import TestBroker


def one_device_fleet(tmp: Path, broker: TestBroker, device: str, device_password: bool = True) -> Path:
    """Write ``tmp/fleet.yaml``; ``device_password`` also names the device's login file in it."""
    secrets = tmp / "secrets"
    secrets.mkdir()
    (secrets / COORDINATOR_USER).write_text(broker.credentials[COORDINATOR_USER].password)
    credentials = ""
    if device_password:
        (secrets / device).write_text(broker.credentials[device].password)
        credentials = f", credentials: 'file:{secrets / device}'"
    path = tmp / "fleet.yaml"
    path.write_text(
        f"fleet: {broker.fleet}\n"
        f"broker: {{mode: external, url: 'mqtt://127.0.0.1:{broker.address().port}', "
        f"password: 'file:{secrets / COORDINATOR_USER}'}}\n"
        "model: {arch: cnn, num_classes: 10}\n"
        "dataset: {name: digits, partition: iid}\n"
        "ratios: [1, 1/2, 1/4]\n"
        "rounds: 2\nround_deadline_s: 60\non_quorum_miss: skip\n"
        "training: {batch_size: 32, local_epochs: 1, lr: 0.05}\n"
        f"devices:\n  - {{id: {device}, profile: x86-laptop-cpu{credentials}}}\n"
    )
    return path


def coordinator_command(fleet: Path, run_dir: Path) -> list[str]:
    """``coordinator start`` on that fleet: no live view, waiting up to 60 s for its one device."""
    command = [sys.executable, "-m", "coordinator", "start", "--fleet", str(fleet), "--run-dir", str(run_dir)]
    return [*command, "--no-live", "--min-devices", "1", "--wait-timeout", "60"]


def device_settings(tmp: Path, broker: TestBroker, device: str) -> dict[str, Any]:
    """The agent.yaml of the fleet's device: the suite's broker, its login file, the CPU, state under ``tmp``."""
    return {
        "device": device,
        "fleet": broker.fleet,
        "transport": {
            "broker": {
                "url": f"mqtt://127.0.0.1:{broker.address().port}",
                "password": f"file:{tmp / 'secrets' / device}",
            }
        },
        "device_type": "cpu",
        "state_dir": str(tmp / "agent"),
    }


@contextmanager
def serving(agent: Agent, coordinator: subprocess.Popen) -> Iterator[None]:
    """``agent`` runs in a thread beside the ``coordinator`` process for the block; both are gone after it."""
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        agent.stop()
        thread.join(timeout=30)
        if coordinator.poll() is None:
            coordinator.kill()
