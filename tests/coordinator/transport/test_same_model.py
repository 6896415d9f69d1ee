"""One device runtime: the same seeds give the same model bytes over memory and over a real mosquitto.

Both fleets are the real round engine and three real :class:`~device_agent.agent.runtime.Agent` s (FedHM at
levels 1, 1/2 and 1/4 on digits, three rounds); only the transport differs: a
:class:`~coordinator.transport.memory_link.MemoryLink` or an :class:`~coordinator.transport.link.MqttLink`
with each agent on its own MQTT session. The agents over MQTT take turns the way the memory transport's do
(the upload gate learns from accepted updates in arrival order, so the order is part of the result).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import yaml

from coordinator.config.fleet import parse_fleet
from coordinator.emulation.simulation import fixed_levels, simulation_fleet
from coordinator.rounds.engine import EngineSettings, RoundEngine
from coordinator.run.rundir import RunDir
from coordinator.strategies import ModelSpec, build_strategy
from coordinator.transport.link import Link, MqttLink
from coordinator.transport.memory_link import LocalDevice, MemoryLink, TakingTurns, Turns
from device_agent.agent.probe import probe_device
from device_agent.agent.runtime import Agent
from device_agent.clients.spec import TrainConfig
from device_agent.data.datasets import LabeledData, load_dataset
from device_agent.wire.codec import encode_tensors
from device_agent.wire.messages import Assignment, RoundFailed
from tests.digit_clients import digit_clients
from tests.transport_fixtures import TestBroker

CNN = ModelSpec("cnn", 10, 1, 8)
DEVICES = ["dev-a", "dev-b", "dev-c"]
LEVELS = [1.0, 0.5, 0.25]
ROUNDS = 3


class TurnTakingMqttLink(MqttLink):
    """The fleet's MQTT link, telling the agents' shared :class:`Turns` what the memory transport tells its own."""

    def __init__(self, turns: Turns, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.turns = turns

    def start(self, on_message, on_payload, on_refused=None, timeout: float = 60.0) -> None:
        def message_in(device, message) -> None:
            on_message(device, message)
            if isinstance(message, RoundFailed):
                self.turns.answered(device)

        def payload_in(device, received) -> None:
            on_payload(device, received)
            self.turns.answered(device)

        super().start(message_in, payload_in, timeout=timeout)

    def send_control(self, device: str, message) -> None:
        if isinstance(message, Assignment):
            self.turns.assigned(device)
        super().send_control(device, message)


def final_model(tmp_path: Path, make_link) -> bytes:
    """Run the fleet over the Link ``make_link(devices)`` gives; the global model after the last round."""
    data = load_dataset("digits", 8, 1)
    clients = digit_clients(DEVICES, LEVELS)
    strategy = build_strategy("fedhm", CNN, {}, seed=0)
    raw = simulation_fleet(strategy, clients, ROUNDS, TrainConfig(batch_size=32)) | {"fleet": "test"}
    tmp_path.mkdir(parents=True)
    fleet_file = tmp_path / "fleet.yaml"
    fleet_file.write_text(yaml.safe_dump(raw))
    rundir = RunDir.create(tmp_path / "run", fleet_file, strategy.state_dict(), seed=0)
    calibration = data.train_x[:128]
    engine = RoundEngine(
        parse_fleet(raw),
        {},
        strategy,
        rundir,
        LabeledData(calibration, calibration.new_zeros(128), data.test_x, data.test_y, 10),
        make_link([LocalDevice(c.client_id, c.train, c.test) for c in clients]),
        EngineSettings(min_devices=len(DEVICES), wait_timeout_s=60),
        planner=fixed_levels(dict(zip(DEVICES, LEVELS, strict=True))),
    )
    try:
        assert engine.run()
        return encode_tensors(rundir.load_state(ROUNDS))
    finally:
        rundir.close()


@pytest.mark.slow
def test_three_rounds_over_memory_and_over_mqtt_end_with_the_same_model_bytes(
    mosquitto: TestBroker, tmp_path: Path
) -> None:
    profile = probe_device(0.2, "cpu")
    over_memory = final_model(tmp_path / "memory", lambda devices: MemoryLink(devices, "test", profile=profile))

    turns = Turns()
    agents: list[Agent] = []

    def mqtt_fleet(devices: list[LocalDevice]) -> Link:
        for device in devices:
            config = mosquitto.agent_config(device.device_id, tmp_path)
            agents.append(Agent(config, profile, TakingTurns(turns, device.device_id), data=device))
        for agent in agents:
            threading.Thread(target=agent.run, name=f"agent-{agent.config.device}", daemon=True).start()
        return TurnTakingMqttLink(turns, mosquitto.fleet, mosquitto.address())

    try:
        over_mqtt = final_model(tmp_path / "mqtt", mqtt_fleet)
    finally:
        for agent in agents:
            agent.stop()

    assert over_memory != encode_tensors(build_strategy("fedhm", CNN, {}, seed=0).state_dict())  # it trained
    assert over_mqtt == over_memory
