"""The emulated demo on the amqtt fallback broker: what `make demo` does on a host without mosquitto.

amqtt speaks MQTT 3.1.1 only; the coordinator and the agents it launches must speak it too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from coordinator.transport.broker import factory
from coordinator.transport.broker.amqtt_broker import AmqttBroker
from coordinator.transport.broker.base import BrokerSettings, free_port
from coordinator.transport.broker.credentials import generate_credentials
from tests.paths import REPO_ROOT

ROOT = REPO_ROOT
DEMO = ROOT / "examples" / "demo.yaml"


def test_auto_falls_back_to_amqtt_which_asks_for_mqtt_3_1_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(factory, "find_mosquitto", lambda: None)
    settings = BrokerSettings("demo", tmp_path, generate_credentials(["dev-a"]))
    with pytest.warns(RuntimeWarning, match="mosquitto is not installed"):
        broker = factory.make_broker(settings)
    assert isinstance(broker, AmqttBroker)
    assert broker.protocol == "3.1.1"


@pytest.mark.slow
def test_demo_runs_on_the_amqtt_fallback(tmp_path: Path) -> None:
    fleet = yaml.safe_load(DEMO.read_text())
    fleet["transport"]["broker"] = {"mode": "amqtt", "host": "127.0.0.1", "port": free_port()}
    fleet["rounds"] = 2
    fleet["devices"] = fleet["devices"][::3]  # one device of each class
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(fleet, sort_keys=False))
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "coordinator", "emulate", "--fleet", str(path), "--run-dir", str(run_dir)]
    done = subprocess.run([*command, "--no-live"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "(amqtt, MQTT 3.1.1)" in done.stdout
    rounds = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rounds) == 2
    assert all(d["status"] == "accepted" for r in rounds for d in r["devices"].values())
    for device in fleet["devices"]:
        agent = yaml.safe_load((run_dir / "agents" / device["id"] / "agent.yaml").read_text())
        assert agent["transport"]["broker"]["protocol"] == "3.1.1"
