"""Secure aggregation over a real mosquitto: the round engine and five real Agents, each on its own MQTT login.

Round 1 sums all five devices' masked updates; in round 2 one agent dies as its training starts (after the key
exchange, so its pairwise masks are in the others' inputs), and the round still closes on the other four.
(With three devices and the smallest threshold, 2, no dropout can be survived: each survivor keeps 1 neighbour.)
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from benchmarks.screening import OFF
from coordinator.config.fleet import parse_fleet
from coordinator.emulation.simulation import fixed_levels, simulation_fleet
from coordinator.rounds.engine import EngineSettings, RoundEngine
from coordinator.run.rundir import RunDir
from coordinator.strategies import ModelSpec, build_strategy
from coordinator.transport.broker.base import BrokerSettings
from coordinator.transport.broker.credentials import generate_credentials
from coordinator.transport.broker.mosquitto import MosquittoBroker, find_mosquitto
from coordinator.transport.broker.scratch import scratch_dir
from coordinator.transport.link import MqttLink
from coordinator.transport.memory_link import LocalDevice
from device_agent.agent.hooks import RuntimeHooks
from device_agent.agent.probe import probe_device
from device_agent.agent.runtime import Agent
from device_agent.clients.spec import TrainConfig
from device_agent.data.datasets import LabeledData, load_dataset
from tests.digit_clients import digit_clients
from tests.transport_fixtures import TestBroker


@pytest.fixture
def broker() -> Iterator[TestBroker]:
    """A mosquitto with a login for each of the five devices (the shared fixture has three)."""
    if find_mosquitto() is None:
        pytest.skip("mosquitto is not installed (apt-get install mosquitto)")
    running = MosquittoBroker(BrokerSettings("test", scratch_dir("fedfleet-broker-"), generate_credentials(DEVICES)))
    running.start()
    yield TestBroker(running, "test", running.settings.credentials)
    running.stop()


DEVICES = ["dev-a", "dev-b", "dev-c", "dev-d", "dev-e"]


class DiesInRound(RuntimeHooks):
    """Ends the agent's thread as it starts training its ``round``-th round: a device losing power mid-protocol."""

    def __init__(self, round_: int) -> None:
        self.round, self.started = round_, 0

    def before_training(self, level: float) -> None:
        self.started += 1
        if self.started == self.round:
            raise SystemExit("powered off")


class WaitsToTrain(RuntimeHooks):
    """Holds the agent's training until ``go`` is set: a slow device, still training when the coordinator stops."""

    def __init__(self) -> None:
        self.go = threading.Event()

    def before_training(self, level: float) -> None:
        assert self.go.wait(60)


def start_agents(broker: TestBroker, tmp_path: Path, clients, hooks: dict[str, RuntimeHooks]) -> list[Agent]:
    """One real Agent per client, each on its own login, running in its own thread."""
    profile = probe_device(0.2, "cpu")
    agents = []
    for client in clients:
        config = broker.agent_config(client.client_id, tmp_path)
        data = LocalDevice(client.client_id, client.train, client.test)
        agents.append(Agent(config, profile, hooks.get(client.client_id, RuntimeHooks()), data=data))
    for agent in agents:
        threading.Thread(target=agent.run, name=f"agent-{agent.config.device}", daemon=True).start()
    return agents


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # dev-c's thread powered off
def test_two_secure_rounds_over_mqtt_one_device_dying_mid_protocol(broker: TestBroker, tmp_path: Path) -> None:
    data = load_dataset("digits", 8, 1)
    clients = digit_clients(DEVICES)
    strategy = build_strategy("fedavg", ModelSpec("cnn", 10, 1, 8), {}, seed=0)
    raw = simulation_fleet(strategy, clients, 2, TrainConfig(batch_size=32), limits=OFF, quorum=0.8) | {
        "fleet": "test",
        "round_deadline_s": 120,
        "secure_aggregation": {"threshold": 2, "neighbours": 4},
    }
    fleet_file = tmp_path / "fleet.yaml"
    fleet_file.write_text(yaml.safe_dump(raw))
    rundir = RunDir.create(tmp_path / "run", fleet_file, strategy.state_dict(), seed=0)
    agents = start_agents(broker, tmp_path, clients, {"dev-c": DiesInRound(2)})
    calibration = data.train_x[:128]
    engine = RoundEngine(
        parse_fleet(raw),
        {},
        strategy,
        rundir,
        LabeledData(calibration, calibration.new_zeros(128), data.test_x, data.test_y, 10),
        MqttLink(broker.fleet, broker.address()),
        EngineSettings(min_devices=len(DEVICES), wait_timeout_s=60),
        planner=fixed_levels(dict.fromkeys(DEVICES, 1.0)),
    )
    try:
        assert engine.run()
        metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    finally:
        rundir.close()
        for agent in agents:
            agent.stop()

    statuses = [{d: m["status"] for d, m in row["devices"].items()} for row in metrics]
    assert statuses[0] == dict.fromkeys(DEVICES, "accepted")
    assert statuses[1] == {**dict.fromkeys(DEVICES, "accepted"), "dev-c": statuses[1]["dev-c"]}
    assert statuses[1]["dev-c"] != "accepted"
    assert metrics[1]["accuracy"] > 0.5
    assert not (tmp_path / "run" / "journal").exists() or not any((tmp_path / "run" / "journal").rglob("*.*"))


@pytest.mark.slow
def test_a_coordinator_restarted_mid_protocol_reruns_the_round_with_fresh_masks(
    broker: TestBroker, tmp_path: Path
) -> None:
    data = load_dataset("digits", 8, 1)
    clients = digit_clients(DEVICES)
    strategy = build_strategy("fedavg", ModelSpec("cnn", 10, 1, 8), {}, seed=0)
    raw = simulation_fleet(strategy, clients, 1, TrainConfig(batch_size=32), limits=OFF) | {
        "fleet": "test",
        "round_deadline_s": 120,
        "secure_aggregation": {"threshold": 2, "neighbours": 4},
    }
    fleet_file = tmp_path / "fleet.yaml"
    fleet_file.write_text(yaml.safe_dump(raw))
    RunDir.create(tmp_path / "run", fleet_file, strategy.state_dict(), seed=0).close()
    slow = WaitsToTrain()
    agents = start_agents(broker, tmp_path, clients, {"dev-e": slow})
    calibration = data.train_x[:128]
    sessions = []

    def engine() -> tuple[RoundEngine, RunDir]:
        rundir = RunDir.open(tmp_path / "run", fleet_file)
        fresh = build_strategy("fedavg", ModelSpec("cnn", 10, 1, 8), {}, seed=0)
        return RoundEngine(
            parse_fleet(raw),
            {},
            fresh,
            rundir,
            LabeledData(calibration, calibration.new_zeros(128), data.test_x, data.test_y, 10),
            MqttLink(broker.fleet, broker.address()),
            EngineSettings(min_devices=len(DEVICES), wait_timeout_s=60),
            planner=fixed_levels(dict.fromkeys(DEVICES, 1.0)),
        ), rundir

    def killed_once_masked_inputs_come(running: RoundEngine) -> None:
        secure = running.secure
        if secure is not None and secure.masking and secure.server.pending() == {"dev-e"}:
            sessions.append(secure.session)
            running.stop()  # as a kill: nothing of the round is committed

    try:
        first, rundir = engine()
        assert not first.run(killed_once_masked_inputs_come)  # four masked inputs in, dev-e still training
        rundir.close()
        slow.go.set()
        second, rundir = engine()
        assert second.run(lambda running: running.secure and sessions.append(running.secure.session))
        metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        rundir.close()
    finally:
        slow.go.set()
        for agent in agents:
            agent.stop()

    assert [{d: m["status"] for d, m in row["devices"].items()} for row in metrics] == [
        dict.fromkeys(DEVICES, "accepted")
    ]
    assert sessions[0].round == sessions[-1].round == 1 and sessions[0].attempt != sessions[-1].attempt
