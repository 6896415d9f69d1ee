"""fleet.yaml's ``transport.kind`` picks the engine's Link; what a kind needs and lacks is named."""

from __future__ import annotations

import pytest
import torch

from coordinator.config.fleet import parse_fleet
from coordinator.transport.fleet_link import fleet_link
from coordinator.transport.link import MqttLink
from coordinator.transport.memory_link import LocalDevice, MemoryLink
from device_agent.wire.session import BrokerAddress


def fleet(kind: str | None = None):
    transport = {} if kind is None else {"transport": {"kind": kind}}
    return parse_fleet(
        {"fleet": "lab", "broker": {"mode": "amqtt"}, "devices": [{"id": "dev-a", "profile": "reported"}]} | transport
    )


def test_mqtt_is_the_default_and_connects_to_the_given_broker() -> None:
    link = fleet_link(fleet(), BrokerAddress.from_url("mqtt://127.0.0.1:1883"))
    assert isinstance(link, MqttLink) and link.fleet == "lab"
    with pytest.raises(ValueError, match=r"transport\.kind: mqtt needs a broker"):
        fleet_link(fleet("mqtt"))


def test_in_process_needs_the_devices_data_in_this_process() -> None:
    shard = (torch.zeros(4, 1, 8, 8), torch.zeros(4, dtype=torch.long))
    link = fleet_link(fleet("in_process"), devices=[LocalDevice("dev-a", shard, shard)])
    assert isinstance(link, MemoryLink) and list(link.devices) == ["dev-a"]
    with pytest.raises(ValueError, match=r"in_process needs the devices' data in this process.*simulate\(\)"):
        fleet_link(fleet("in_process"), BrokerAddress.from_url("mqtt://127.0.0.1:1883"))
