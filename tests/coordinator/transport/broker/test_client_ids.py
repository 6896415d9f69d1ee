"""Client ids are bound to logins: one device's credentials cannot take over another client's connection.

mosquitto closes an existing connection when a new one arrives with the same client id; without
``use_username_as_clientid`` any device's login could kick a neighbour or the coordinator that way.
"""

from __future__ import annotations

import time

import pytest

from device_agent.wire.messages import Message, Status
from device_agent.wire.session import Session, SessionConfig, coordinator_session, device_session
from tests.waiting import until


@pytest.mark.slow
def test_a_device_login_cannot_kick_another_device_or_the_coordinator(fresh_mosquitto) -> None:
    broker = fresh_mosquitto
    coordinator = coordinator_session(broker.fleet, broker.address()).start()
    victim, _topics = device_session(broker.fleet, "dev-b", broker.address("dev-b"))
    victim.start()
    try:
        for client_id in (f"fedfleet-{broker.fleet}-dev-b", f"fedfleet-{broker.fleet}-coordinator"):
            intruder = Session(SessionConfig(client_id=client_id, broker=broker.address("dev-a")), subscriptions=[])
            intruder.start()
            try:
                assert until(lambda s=intruder: s.connected)  # it got in, as dev-a (late on a loaded host) ...
                time.sleep(1.5)  # ... and a takeover would disconnect it at once; a session reconnects after ~1 s
                assert intruder.connected  # ... and took nobody's place
            finally:
                intruder.stop()
        assert coordinator.connected and victim.connected
        assert coordinator.stats.connects == 1 and victim.stats.connects == 1  # never dropped
    finally:
        victim.stop()
        coordinator.stop()


def test_a_device_session_persists_under_its_user_name(fresh_mosquitto) -> None:
    """What the broker queued while the device was away reaches it after it reconnects."""
    broker = fresh_mosquitto
    received: list[Message] = []
    coordinator = coordinator_session(broker.fleet, broker.address()).start()
    device, topics = device_session(
        broker.fleet, "dev-a", broker.address("dev-a"), on_message=lambda _topic, m: received.append(m)
    )
    device.start()
    # Subscribed: a message reaches it (a fixed sleep lost the subscription to a loaded host's delay).
    deadline = time.monotonic() + 60
    while not received and time.monotonic() < deadline:
        coordinator.publish(topics.down, Status(device="dev-a", state="idle", detail="live"))
        time.sleep(0.2)
    assert received, "the device never got a message on its downlink"
    device.stop()
    received.clear()
    device, topics = device_session(
        broker.fleet, "dev-a", broker.address("dev-a"), on_message=lambda _topic, m: received.append(m)
    )
    try:
        coordinator.publish(topics.down, Status(device="dev-a", state="idle", detail="queued"))
        time.sleep(0.3)
        device.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(getattr(m, "detail", None) == "queued" for m in received):
            time.sleep(0.05)
        # Late copies of the subscription probe ("live") may arrive too; the queued message arrives once.
        assert [m.detail for m in received if isinstance(m, Status) and m.detail != "live"] == ["queued"]
    finally:
        device.stop()
        coordinator.stop()
