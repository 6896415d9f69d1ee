"""Every frame a device sends costs it a token, whatever it is, and only its documented topics are read.

A device login floods the coordinator's session over a real mosquitto with the frames that once
slipped past the rate limit (wrong-version messages, chunk frames) and with frames on made-up
sub-topics, which once left per-topic state behind for good.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from device_agent.wire.budget import InboundBudget
from device_agent.wire.guard import InboundGuard, InboundLimits
from device_agent.wire.messages import encode
from device_agent.wire.session import coordinator_session
from device_agent.wire.topics import DeviceTopics, uplink_device
from device_agent.wire.transfer import announce, chunk_frame
from tests.waiting import until


def test_chunk_frames_and_messages_each_have_a_bucket_per_device() -> None:
    budget = InboundBudget(messages_per_s=10, burst=3, chunk_frames_per_s=100, chunk_burst=5)
    assert [budget.take("a", chunk=False, now=0.0) for _ in range(4)] == [True, True, True, False]
    assert [budget.take("a", chunk=True, now=0.0) for _ in range(6)] == [True] * 5 + [False]
    assert budget.take("b", chunk=False, now=0.0) and budget.take("b", chunk=True, now=0.0)
    assert budget.take("a", chunk=False, now=0.1)  # refilled at its rate
    assert budget.peers() == 2


def test_only_the_documented_sub_topics_belong_to_a_device() -> None:
    t = DeviceTopics("fleet", "dev-a")
    assert uplink_device(t.up) == "dev-a" and uplink_device(t.status) == "dev-a"
    for topic in (f"{t.base}/up/t1", f"{t.base}/up/data/x", t.down, f"{t.base}/up", "x"):
        assert uplink_device(topic) is None, topic


class _Flooder:
    """A raw MQTT client holding a device's login, reading what the coordinator answers it."""

    def __init__(self, broker, device: str) -> None:
        self.topics = DeviceTopics(broker.fleet, device)
        self.answers: list[dict] = []
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=device, protocol=mqtt.MQTTv5)
        login = broker.address(device)
        self.client.username_pw_set(login.username, login.password)
        self.client.on_message = lambda _c, _u, msg: self.answers.append(json.loads(msg.payload))
        subscribed = threading.Event()
        self.client.on_subscribe = lambda *_a: subscribed.set()
        self.client.connect(login.host, login.port)
        self.client.loop_start()
        self.client.subscribe(self.topics.down, qos=1)
        assert subscribed.wait(60)

    def publish(self, frames: list[tuple[str, bytes]]) -> None:
        infos = [self.client.publish(topic, data, qos=1) for topic, data in frames]
        for info in infos:
            info.wait_for_publish(30)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def _settle() -> None:
    """Time for the coordinator's network thread to take what the broker has already acked to the flooder."""
    time.sleep(1.0)


@pytest.mark.parametrize("flood", ["wrong_version", "chunk_frames"])
def test_every_inbound_frame_counts_against_the_device_s_rate(fresh_mosquitto, flood: str) -> None:
    broker = fresh_mosquitto
    refused: Counter[tuple[str, str]] = Counter()
    limits = InboundLimits(messages_per_s=5, burst=20, chunk_frames_per_s=5, chunk_burst=20, quiet_s=30)
    guard = InboundGuard(limits, lambda peer, reason: refused.update([(peer, reason)]))
    coordinator = coordinator_session(broker.fleet, broker.address(), guard=guard)
    coordinator.start()
    mallory = _Flooder(broker, "dev-a")
    try:
        up = mallory.topics.up
        if flood == "wrong_version":
            frames = [(up, json.dumps({"v": 99, "type": "status"}).encode())] * 500
        else:
            transfer = announce(10 << 20, 1 << 20).transfer
            frames = [(up, chunk_frame(transfer, i % 10, bytes(1024))) for i in range(500)]
        mallory.publish(frames)
        floor = 500 - 20 - 5 * 10  # at most the burst and a few seconds' rate get through
        until(lambda: refused[("dev-a", "rate_limited")] >= floor)
    finally:
        mallory.close()
        coordinator.stop()
    assert refused[("dev-a", "rate_limited")] >= floor
    incompatible = [a for a in mallory.answers if a.get("code") == "incompatible"]
    assert len(incompatible) <= 1  # one answer per burst of wrong-version messages, not one per message


def test_frames_on_made_up_sub_topics_leave_no_state_behind(fresh_mosquitto) -> None:
    broker = fresh_mosquitto
    refused: Counter[tuple[str, str]] = Counter()
    guard = InboundGuard(InboundLimits(burst=10_000, chunk_burst=10_000), lambda p, r: refused.update([(p, r)]))
    coordinator = coordinator_session(broker.fleet, broker.address(), guard=guard)
    coordinator.start()
    mallory = _Flooder(broker, "dev-a")
    try:
        base = mallory.topics.base
        manifest = announce(10 << 20, 1 << 20)
        frames = []
        for n in range(300):
            made_up = f"{base}/up/t{n}"
            frames += [(made_up, encode(manifest)), (made_up, chunk_frame(manifest.transfer, 0, b"x"))]
        mallory.publish(frames)
        _settle()
        assert coordinator.receiving() == []
        assert set(coordinator.stats.bytes_in) <= {mallory.topics.up, mallory.topics.status}
        # The broker's ACL names each device's topics exactly: none of them even arrives. (A broker without
        # that ACL meets the session's own allow-list, topics.uplink_device, tested above.)
        assert refused[("dev-a", "wrong_topic")] == 0
        # The documented topic still works, and holds one receiver for the device, not one per topic.
        mallory.publish([(mallory.topics.up, encode(manifest))])
        assert until(lambda: coordinator.receiving() == [manifest.transfer]), coordinator.receiving()
        assert len(coordinator.receivers.peers) == 1
    finally:
        mallory.close()
        coordinator.stop()
