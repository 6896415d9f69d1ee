"""Managed brokers: per-device confinement by real ACLs, credentials, files, the amqtt fallback."""

import os
import pwd
import threading
import warnings

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion

from coordinator.transport.broker import factory
from coordinator.transport.broker.amqtt_broker import AmqttBroker, covers
from coordinator.transport.broker.base import BrokerSettings, probe
from coordinator.transport.broker.credentials import Credentials, generate_credentials, hash_password, verify_password
from coordinator.transport.broker.mosquitto import MosquittoBroker, acl_text
from device_agent.wire.topics import DeviceTopics


class Client:
    """A plain paho client logged in as one user, recording what it receives."""

    def __init__(self, address, name, v5=True):
        self.received = []
        self.got = threading.Event()
        self.acks = {}
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=f"acl-{name}",
            protocol=MQTTProtocolVersion.MQTTv5 if v5 else MQTTProtocolVersion.MQTTv311,
        )
        self.client.username_pw_set(address.username, address.password)
        self.client.on_message = lambda _c, _u, msg: (self.received.append(msg.topic), self.got.set())
        self.client.on_publish = lambda _c, _u, mid, reason, _p: self.acks.__setitem__(mid, reason)
        self.client.connect(address.host, address.port)
        self.client.loop_start()

    def subscribe(self, topic):
        done = threading.Event()
        granted = []
        self.client.on_subscribe = lambda _c, _u, _mid, codes, _p: (granted.extend(codes), done.set())
        self.client.subscribe(topic, qos=1)
        assert done.wait(60)
        return granted[0]

    def publish(self, topic):
        info = self.client.publish(topic, b"x", qos=1)
        info.wait_for_publish(5)
        return self.acks.get(info.mid)

    def close(self):
        self.client.disconnect()
        self.client.loop_stop()


def confinement(broker, v5):
    a_topics, b_topics = DeviceTopics(broker.fleet, "dev-a"), DeviceTopics(broker.fleet, "dev-b")
    coordinator = Client(broker.address(), "coord", v5)
    a = Client(broker.address("dev-a"), "a", v5)
    try:
        # up/data only: retained statuses left by other tests would arrive on up/#
        assert coordinator.subscribe(f"fedfleet/{broker.fleet}/dev/+/up/data").value < 128
        # A cannot write into B's subtree: denied (v5 says so in the PUBACK) and never delivered.
        reason = a.publish(b_topics.up)
        if v5:
            assert reason.is_failure and "authori" in str(reason).lower()
        a.publish(a_topics.up)
        assert coordinator.got.wait(60)
        assert coordinator.received == [a_topics.up]
        # A cannot read B's downloads, neither by name nor by wildcard. (mosquitto may grant the
        # subscription and then filter every delivery by the read ACL; amqtt refuses it: what
        # counts is that nothing of B's arrives.)
        for topic in (b_topics.down, f"fedfleet/{broker.fleet}/dev/+/down/#"):
            a.subscribe(topic)
        assert a.subscribe(a_topics.down).value < 128
        coordinator.publish(b_topics.down)
        coordinator.publish(a_topics.down)  # published after B's: B's would have arrived first
        assert a.got.wait(60)
        assert set(a.received) == {a_topics.down}  # twice when the wildcard overlaps its own topic
    finally:
        coordinator.close()
        a.close()


@pytest.mark.parametrize("v5", [True, False], ids=["mqtt5", "mqtt311"])
def test_mosquitto_confines_each_device_to_its_own_subtree(mosquitto, v5):
    confinement(mosquitto, v5)


def test_amqtt_confines_each_device_to_its_own_subtree(amqtt):
    confinement(amqtt, v5=False)


@pytest.mark.parametrize("kind", ["mosquitto", "amqtt"])
def test_a_wrong_password_or_unknown_user_is_refused(kind, request):
    broker = request.getfixturevalue(kind)
    assert probe(broker.address("dev-a"), 30) == "ok"
    assert probe(broker.broker.address_for(Credentials("dev-a", "wrong")), 30).startswith("refused")
    assert probe(broker.broker.address_for(Credentials("intruder", "x")), 30).startswith("refused")


def test_generated_files_are_private_yet_readable_by_the_mosquitto_user(mosquitto):
    workdir = mosquitto.broker.workdir
    for name in ("passwd", "acl", "mosquitto.conf"):
        mode = os.stat(workdir / name).st_mode & 0o777
        assert mode == 0o640, name
        if os.geteuid() == 0:
            assert os.stat(workdir / name).st_uid == pwd.getpwnam("mosquitto").pw_uid
    config = (workdir / "mosquitto.conf").read_text()
    for line in ("allow_anonymous false", "max_packet_size 8388608", "max_queued_messages 1000", "persistence true"):
        assert line in config
    assert "pattern write fedfleet/test/dev/%u/up/data" in acl_text("test")
    assert "up/#" not in acl_text("test") and "down/#" not in acl_text("test")
    assert (workdir / "passwd").read_text().count("$7$101$") == len(mosquitto.credentials)


def test_password_hashes_are_mosquitto_pbkdf2_and_verify():
    hashed = hash_password("s3cret")
    assert hashed.startswith("$7$101$")
    assert verify_password("s3cret", hashed) and not verify_password("S3cret", hashed)
    assert not verify_password("s3cret", "$6$salt$hash")
    creds = generate_credentials(["pi-1", "pi-2"])
    assert set(creds) == {"coordinator", "pi-1", "pi-2"} and "password=***" in repr(creds["pi-1"])
    with pytest.raises(ValueError, match="invalid device name"):
        generate_credentials(["pi/1"])


def test_acl_grants_cover_only_their_subtree():
    grant = "fedfleet/f/dev/a/down/#"
    assert covers(grant, "fedfleet/f/dev/a/down/data")
    assert not covers(grant, "fedfleet/f/dev/b/down/data")
    assert not covers(grant, "fedfleet/f/dev/+/down/#")
    assert not covers(grant, "fedfleet/f/#")


def test_the_factory_prefers_mosquitto_and_warns_loudly_when_falling_back(tmp_path, monkeypatch):
    settings = BrokerSettings("f", tmp_path, generate_credentials([]))
    if factory.find_mosquitto():
        assert isinstance(factory.make_broker(settings), MosquittoBroker)
    monkeypatch.setattr(factory, "find_mosquitto", lambda: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        broker = factory.make_broker(settings)
    assert isinstance(broker, AmqttBroker)
    assert any("mosquitto is not installed" in str(w.message) for w in caught)
    with pytest.raises(ValueError, match="auto, mosquitto or amqtt"):
        factory.make_broker(settings, prefer="rabbitmq")


def test_an_external_broker_is_reached_by_url(mosquitto):
    address = mosquitto.address()
    external = factory.external_broker(f"mqtt://{address.host}:{address.port}", address.username, address.password)
    external.start(timeout=60)
    assert probe(external.address_for(mosquitto.credentials["dev-c"]), 30) == "ok"
