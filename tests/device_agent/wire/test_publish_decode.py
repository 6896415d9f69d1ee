"""The sessions' client decodes a QoS 1 PUBLISH as paho does, without copying the payload."""

from __future__ import annotations

import struct

import paho.mqtt.client as mqtt
import pytest
from hypothesis import given
from hypothesis import strategies as st
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from device_agent.wire.client import LeanClient

PUBLISH = 0x30


def client(protocol: MQTTProtocolVersion, kind: type[mqtt.Client] = LeanClient) -> mqtt.Client:
    return kind(CallbackAPIVersion.VERSION2, client_id="decode-test", protocol=protocol, manual_ack=True)


def handed_over(kind: type[mqtt.Client], protocol: MQTTProtocolVersion, header: int, body: bytes) -> mqtt.MQTTMessage:
    """The message a client's on_message gets for one inbound PUBLISH, through the client's own handler."""
    receiver, got = client(protocol, kind), []
    receiver.on_message = lambda _client, _userdata, message: got.append(message)
    receiver._in_packet = {"command": header, "packet": bytearray(body)}
    assert receiver._handle_publish() == mqtt.MQTTErrorCode.MQTT_ERR_SUCCESS  # manual ack: no PUBACK to send
    [message] = got
    return message


def publish_body(topic: bytes, mid: int, payload: bytes, properties: Properties | None) -> bytearray:
    """A PUBLISH packet after its fixed header, as a broker sends it."""
    body = struct.pack("!H", len(topic)) + topic + struct.pack("!H", mid)
    if properties is not None:
        body += properties.pack()
    return bytearray(body + payload)


def v5_properties(expiry: int | None, user: list[tuple[str, str]]) -> Properties:
    properties = Properties(PacketTypes.PUBLISH)
    if expiry is not None:
        properties.MessageExpiryInterval = expiry
    if user:
        properties.UserProperty = user
    return properties


# What MQTT allows in a UTF-8 string: no surrogates, no null, no byte order mark (paho refuses a packet holding one).
mqtt_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00\ufeff"), max_size=8)


@given(
    topic=st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=40).map(str.encode),
    mid=st.integers(1, 65535),
    payload=st.binary(max_size=2048),
    dup=st.booleans(),
    retain=st.booleans(),
    v5=st.booleans(),
    expiry=st.none() | st.integers(0, 2**32 - 1),
    user=st.lists(st.tuples(mqtt_text, mqtt_text), max_size=2),
)
def test_a_qos1_publish_decodes_as_paho_decodes_it(topic, mid, payload, dup, retain, v5, expiry, user):
    protocol = MQTTProtocolVersion.MQTTv5 if v5 else MQTTProtocolVersion.MQTTv311
    header = PUBLISH | 0x02 | (0x08 if dup else 0) | (0x01 if retain else 0)
    body = publish_body(topic, mid, payload, v5_properties(expiry, user) if v5 else None)
    ours, theirs = (handed_over(kind, protocol, header, body) for kind in (LeanClient, mqtt.Client))
    assert isinstance(ours.payload, memoryview)
    fields = ("_topic", "mid", "qos", "dup", "retain")
    assert [getattr(ours, f) for f in fields] == [getattr(theirs, f) for f in fields] == [topic, mid, 1, dup, retain]
    assert bytes(ours.payload) == theirs.payload == payload
    if v5:
        assert ours.properties.json() == theirs.properties.json()


def test_the_payload_is_a_read_only_view_of_the_packet_not_a_copy():
    body = publish_body(b"fleet/dev/up/data", 7, b"x" * 1000, None)
    message = client(MQTTProtocolVersion.MQTTv311)._qos1_message(PUBLISH | 0x02, body)
    assert isinstance(message.payload, memoryview) and message.payload.readonly
    assert message.payload.obj is body  # the session keeps a verified chunk as it came, no copy
    with pytest.raises(BufferError):  # and nobody can grow the buffer under the view
        body += b"more"


@pytest.mark.parametrize(
    "header, body",
    [
        (PUBLISH, publish_body(b"t", 0, b"qos 0", None)),  # no packet id
        (PUBLISH | 0x04, publish_body(b"t", 3, b"qos 2", None)),  # paho's own handshake
        (PUBLISH | 0x02, bytearray(b"\x00\x09to")),  # topic longer than the packet
    ],
    ids=["qos0", "qos2", "truncated"],
)
def test_anything_but_a_well_formed_qos1_publish_is_left_to_paho(header, body):
    assert client(MQTTProtocolVersion.MQTTv311)._qos1_message(header, body) is None


def test_v5_properties_past_the_end_of_the_packet_are_left_to_paho():
    body = bytearray(struct.pack("!H", 1) + b"t" + struct.pack("!H", 1) + b"\x20")  # 32 bytes of properties, none sent
    assert client(MQTTProtocolVersion.MQTTv5)._qos1_message(PUBLISH | 0x02, body) is None


def test_v5_properties_paho_finds_malformed_are_left_to_paho():
    properties = v5_properties(None, [("key", "a\x00b")])  # MQTT forbids a null in a UTF-8 string
    body = publish_body(b"t", 1, b"payload", properties)
    assert client(MQTTProtocolVersion.MQTTv5)._qos1_message(PUBLISH | 0x02, body) is None
