"""The MQTT link of a fleet holds its devices to fleet.yaml's ``limits``, on a real broker."""

from __future__ import annotations

import os
import threading

import pytest

from coordinator.config.fleet import parse_fleet
from coordinator.transport.link import MqttLink
from device_agent.wire.payload import Received
from device_agent.wire.session import device_session
from device_agent.wire.transfer import TransferError
from tests.transport_fixtures import TestBroker


def test_an_upload_over_the_fleets_max_upload_bytes_is_refused_and_a_smaller_one_arrives(
    mosquitto: TestBroker,
) -> None:
    fleet = parse_fleet(
        {
            "fleet": mosquitto.fleet,
            "transport": {"broker": {"mode": "managed"}},
            "devices": [{"id": "dev-a", "profile": "reported"}],
            "limits": {"max_upload_bytes": "64 KiB"},
        }
    )
    refused: list[tuple[str, str]] = []
    arrived: list[tuple[str, int]] = []
    done = threading.Event()

    def on_payload(device: str, received: Received) -> None:
        arrived.append((device, len(received.data)))
        done.set()

    link = MqttLink.of(fleet, mosquitto.address())
    link.start(lambda _device, _message: None, on_payload, lambda device, reason: refused.append((device, reason)))
    device, topics = device_session(mosquitto.fleet, "dev-a", mosquitto.address("dev-a"))
    device.start()
    try:
        with pytest.raises(TransferError, match="too_large: 131072 bytes exceed the 65536-byte transfer limit"):
            device.send(topics.up, os.urandom(128 << 10), kind="update").wait(10)
        device.send(topics.up, os.urandom(32 << 10), kind="update").wait(10)
        assert done.wait(60)
    finally:
        device.stop()
        link.stop()
    assert set(refused) == {("dev-a", "transfer_refused")}  # its announcement and its seal
    assert arrived == [("dev-a", 32 << 10)]


def test_closing_a_round_stops_its_downloads_and_refuses_its_late_uploads(mosquitto: TestBroker) -> None:
    """What still travels for a closed round cannot hold up the next: a model still on its way to a device
    stops, and the device's update for that round is refused at its manifest, before any chunk is taken."""
    fleet = parse_fleet(
        {
            "fleet": mosquitto.fleet,
            "transport": {"broker": {"mode": "managed"}},
            "devices": [{"id": "dev-a", "profile": "reported"}],
        }
    )
    arrived: list[int] = []
    done = threading.Event()

    def on_payload(_device: str, received: Received) -> None:
        arrived.append(received.round)
        done.set()

    release = threading.Event()
    link = MqttLink.of(fleet, mosquitto.address())
    link.start(lambda _device, _message: None, on_payload)
    # A device whose link holds every inbound chunk until released: round 1's model is still on its way.
    device, topics = device_session(
        mosquitto.fleet, "dev-a", mosquitto.address("dev-a"), after_chunk_in=lambda _size: release.wait(10)
    )
    device.start()
    try:
        model = os.urandom(3 << 20)
        link.send_payload("dev-a", model, link.prepare(model, round=1, kind="assignment"))
        assert link.payload_in_flight("dev-a")
        link.close_round(1)
        assert not link.payload_in_flight("dev-a")
        release.set()
        with pytest.raises(TransferError, match="round 1 is closed"):
            device.send(topics.up, os.urandom(32 << 10), round=1, kind="update").wait(10)
        device.send(topics.up, os.urandom(32 << 10), round=2, kind="update").wait(10)
        assert done.wait(60)
    finally:
        device.stop()
        link.stop()
    assert arrived == [2]
