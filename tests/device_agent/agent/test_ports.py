"""A port kind is a plugin: one module in another package, registered through an entry point, no edit of fedfleet.

The plugin, ``recorder`` (:mod:`tests.device_agent.recorder_port`), is a coordinator that only listens: its port
writes what the agent says to a file and, once it has heard the agent's hello, stops the agent's process as Ctrl-C
would. Enough to show that ``Agent`` and ``device-agent run`` take whatever port agent.yaml's ``transport.kind`` names.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from device_agent.agent.config import ConfigError, load_config, parse_config
from device_agent.agent.lock import device_key
from device_agent.agent.port import MqttPort
from device_agent.agent.ports import PORTS, port_kind_of
from device_agent.agent.runtime import Agent, run_agent
from tests.device_agent.recorder_port import agent_yaml, heard, recorder_installed
from tests.device_profiles import reported_profile
from tests.paths import REPO_ROOT


@pytest.fixture
def recorder_plugin(tmp_path: Path) -> Iterator[Path]:
    with recorder_installed(tmp_path / "site") as site:
        yield site


def test_mqtt_is_the_default_kind_and_its_claim_is_one_login_on_one_broker() -> None:
    config = parse_config(
        {"device": "dev-a", "fleet": "lab", "transport": {"broker": {"url": "mqtts://broker.lan:8883"}}}
    )

    assert config.transport.kind == "mqtt" and "mqtt" in PORTS
    assert isinstance(port_kind_of(config).port(config), MqttPort)
    assert port_kind_of(config).claim_key(config) == device_key("broker.lan", 8883, "lab", "dev-a")


def test_an_unknown_kind_is_refused_at_start_naming_the_registered_ones_and_the_entry_point_group(
    tmp_path: Path,
) -> None:
    config = load_config(agent_yaml(tmp_path, "pigeon"))

    with pytest.raises(ConfigError) as refused:
        run_agent(config)

    assert str(refused.value) == (
        "transport.kind: 'pigeon' is not a registered port kind (registered: mqtt, websocket); "
        "a package adds one under the entry point group 'fedfleet.ports'"
    )
    assert not (tmp_path / "state").exists()  # refused before the state folder is locked or written
    with pytest.raises(ConfigError, match="'pigeon' is not a registered port kind"):
        Agent(config, reported_profile())


def test_each_setting_a_kind_refuses_is_a_config_error_naming_its_key(recorder_plugin: Path, tmp_path: Path) -> None:
    mqtt = load_config(agent_yaml(tmp_path / "mqtt", "mqtt", url="mqtt://elsewhere:1883"))
    recorder = load_config(agent_yaml(tmp_path / "recorder", record=3, colour="red"))

    with pytest.raises(ConfigError) as mqtt_refused:
        run_agent(mqtt)
    with pytest.raises(ConfigError) as recorder_refused:
        Agent(recorder, reported_profile())

    assert str(mqtt_refused.value) == "transport.url: not a setting of port kind 'mqtt'"  # broker: holds its url
    assert str(recorder_refused.value) == (
        "transport.colour: not a setting of port kind 'recorder' (it takes record); "
        "transport.record: a file name in the state folder, got 3"
    )


def test_a_kind_that_is_not_a_name_is_a_config_error_naming_its_key() -> None:
    with pytest.raises(ConfigError, match=r"transport\.kind"):
        parse_config({"device": "dev-a", "fleet": "lab", "transport": {"kind": "My Port"}})


def test_an_agent_takes_the_port_of_the_kind_agent_yaml_names(
    recorder_plugin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    heard_hello = threading.Event()
    plugin: ModuleType = sys.modules["recorder_port"]
    monkeypatch.setattr(plugin, "after_hello", heard_hello.set)  # this test's process is not the agent's to stop
    agent = Agent(load_config(agent_yaml(tmp_path, "recorder", record="said.jsonl")), reported_profile())
    serving = threading.Thread(target=agent.run, daemon=True)
    serving.start()
    try:
        assert heard_hello.wait(60)
    finally:
        agent.stop()
        serving.join(30)

    assert type(agent.port).__name__ == "RecorderPort"
    assert agent.port.where == f"a recording in {tmp_path / 'state' / 'said.jsonl'}"  # its own setting, taken
    said = heard(tmp_path / "state", "said.jsonl")
    assert said[0]["type"] == "hello" and said[0]["device"] == "dev-a"
    assert said[-1] == {"stopped": True}


@pytest.mark.slow
def test_device_agent_run_uses_a_port_kind_from_another_package(recorder_plugin: Path, tmp_path: Path) -> None:
    config = agent_yaml(tmp_path, "recorder")
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(recorder_plugin), str(REPO_ROOT)])}
    command = [sys.executable, "-m", "device_agent", "run", "--config", str(config), "--log-level", "WARNING"]

    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)

    assert done.returncode == 0, done.stderr
    state = tmp_path / "state"
    assert json.loads((state / "preflight.json").read_text()) == {"give_up_s": 300.0}  # connect_timeout_s
    said = heard(state)
    assert said[0]["type"] == "hello" and said[0]["device"] == "dev-a"
    assert said[-1] == {"stopped": True}  # stopped gracefully on the signal, not killed
