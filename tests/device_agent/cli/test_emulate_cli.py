"""`device-agent emulate` against a real mosquitto: N real agent processes join, Ctrl-C stops them all."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import psutil
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from coordinator.transport.broker.base import BrokerSettings
from coordinator.transport.broker.credentials import generate_credentials
from coordinator.transport.broker.mosquitto import MosquittoBroker, find_mosquitto
from coordinator.transport.broker.scratch import scratch_dir
from device_agent.agent.config import AgentConfig
from device_agent.wire.messages import Status, parse_message
from device_agent.wire.topics import ROOT

FLEET = "bulk"
DEVICES = [f"pi-{i:02d}" for i in range(3)]


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[tuple[MosquittoBroker, dict]]:
    if find_mosquitto() is None:
        pytest.skip("mosquitto is not installed")
    workdir = scratch_dir("fedfleet-broker-")  # not tmp_path: mosquitto may drop root
    credentials = generate_credentials(DEVICES)
    running = MosquittoBroker(BrokerSettings(FLEET, workdir, credentials))
    running.start()
    yield running, credentials
    running.stop()


def _watch_states(broker: MosquittoBroker, credentials: dict) -> tuple[mqtt.Client, dict[str, str]]:
    """The latest retained status of every device, as the coordinator would see it."""
    states: dict[str, str] = {}
    address = broker.address_for(credentials["coordinator"])
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="test-watcher")
    client.username_pw_set(address.username, address.password)

    def on_message(_c: object, _u: object, msg: mqtt.MQTTMessage) -> None:
        message = parse_message(msg.payload)
        if isinstance(message, Status):
            states[message.device] = message.state

    client.on_message = on_message
    client.on_connect = lambda c, *_: c.subscribe(f"{ROOT}/{FLEET}/dev/+/up/status", qos=1)
    client.connect(address.host, address.port)
    client.loop_start()
    return client, states


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.mark.slow
def test_bulk_launch_joins_n_agents_and_stops_them(broker: tuple[MosquittoBroker, dict], tmp_path: Path) -> None:
    running, credentials = broker
    for device in DEVICES:
        (tmp_path / f"{device}.pw").write_text(credentials[device].password)
    watcher, states = _watch_states(running, credentials)
    command = [
        sys.executable, "-m", "device_agent", "emulate",
        "--profile", "raspberry-pi-4", "--count", str(len(DEVICES)), "--prefix", "pi",
        "--broker", running.address.url, "--fleet", FLEET,
        "--password", f"file:{tmp_path}/{{device}}.pw",
        "--host-gflops", "36", "--run-dir", str(tmp_path / "run"),
    ]  # fmt: skip
    emulate = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for(lambda: set(states) == set(DEVICES), 90, "every agent's status")
        agents = psutil.Process(emulate.pid).children()
        assert len(agents) == len(DEVICES)
        assert all("run" in a.cmdline() and "--config" in a.cmdline() for a in agents)
        for device in DEVICES:
            assert (tmp_path / "run" / device / "agent.yaml").is_file()
        emulate.send_signal(signal.SIGINT)
        output, _ = emulate.communicate(timeout=60)
    finally:
        if emulate.poll() is None:
            emulate.kill()
        watcher.loop_stop()
        watcher.disconnect()
    assert emulate.returncode == 0, output
    assert "3 x raspberry-pi-4: 3 agent processes (one per device, hard OS caps) running" in output
    assert not any(agent.is_running() for agent in agents)
    for device in DEVICES:
        assert f"connected to {running.address.url}" in (tmp_path / "run" / device / "agent.log").read_text()


@pytest.mark.slow
def test_an_agent_that_dies_at_start_up_is_reported(broker: tuple[MosquittoBroker, dict], tmp_path: Path) -> None:
    running, _ = broker
    done = subprocess.run(
        [
            sys.executable, "-m", "device_agent", "emulate",
            "--profile", "raspberry-pi-4", "--count", "1", "--prefix", "pi",
            "--broker", running.address.url, "--fleet", FLEET, "--password", f"file:{tmp_path}/missing/{{device}}.pw",
            "--host-gflops", "36", "--run-dir", str(tmp_path / "run"),
        ],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1
    assert "agent pi-00 exited (exit code 1)" in done.stderr
    assert "cannot read" in done.stderr  # the end of its log comes with the report
    assert "1 of 1 agent processes crashed: pi-00" in done.stderr


def test_bad_settings_are_usage_errors(tmp_path: Path) -> None:
    from device_agent.cli.app import main

    code = main(["emulate", "--profile", "raspbery-pi-4", "--count", "2", "--broker", "mqtt://h", "--fleet", "f",
                 "--host-gflops", "10", "--run-dir", str(tmp_path)])  # fmt: skip
    assert code == 2
    bad = ["emulate", "--profile", "raspberry-pi-4", "--count", "1", "--broker", "mqtt://h", "--fleet", "f",
           "--host-gflops", "10", "--run-dir", str(tmp_path), "--partition", "dirichlet(-1)"]  # fmt: skip
    assert main(bad) == 2
    assert not list(tmp_path.iterdir())  # checked before anything is written or started


def emulated_configs(flags: list[str]) -> list[AgentConfig]:
    """The agent.yaml each agent of ``device-agent emulate --profile raspberry-pi-4 --fleet f FLAGS`` would get."""
    from device_agent.agent.config import load_config
    from device_agent.cli.app import build_parser
    from device_agent.cli.emulate import agent_specs

    command = ["emulate", "--profile", "raspberry-pi-4", "--fleet", "f", "--host-gflops", "10", *flags]
    return [load_config(spec.config) for spec in agent_specs(build_parser().parse_args(command), host_gflops=10)]


def test_relative_flags_are_written_as_the_working_directory_means_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (config,) = emulated_configs(
        ["--count", "1", "--prefix", "pi", "--broker", "mqtts://h:8883", "--password", "file:secrets/{device}.pw",
         "--ca-file", "ca.pem", "--run-dir", "run", "--dataset", "npz", "--data-path", "data/train.npz"]
    )  # fmt: skip

    assert config.state_dir == tmp_path / "run" / "pi-00" / "state"
    assert config.broker.password == f"file:{tmp_path / 'secrets' / 'pi-00.pw'}"
    assert (config.broker.ca_file, config.data.path) == (str(tmp_path / "ca.pem"), str(tmp_path / "data/train.npz"))


def test_each_agent_gets_its_own_client_certificate_from_the_templates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    flags = ["--count", "2", "--first-index", "2", "--total", "4", "--prefix", "edge", "--broker", "mqtts://h:8883",
             "--ca-file", "kits/ca.pem", "--cert-file", "kits/{device}/client.pem",
             "--key-file", "kits/{device}/client.key", "--run-dir", "run"]  # fmt: skip
    brokers = [config.broker for config in emulated_configs(flags)]

    assert [(b.cert_file, b.key_file) for b in brokers] == [
        (str(tmp_path / f"kits/{d}/client.pem"), str(tmp_path / f"kits/{d}/client.key")) for d in ("edge-02", "edge-03")
    ]


def test_a_client_certificate_without_its_key_is_refused(tmp_path: Path) -> None:
    from device_agent.cli.app import main

    command = ["emulate", "--profile", "raspberry-pi-4", "--count", "1", "--broker", "mqtts://h:8883", "--fleet", "f",
               "--cert-file", "c.pem", "--host-gflops", "10", "--run-dir", str(tmp_path)]  # fmt: skip
    assert main(command) == 2
