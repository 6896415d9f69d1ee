"""The sessions' client reads packets off its socket as paho does, each body received straight into its buffer."""

from __future__ import annotations

from unittest.mock import patch

import paho.mqtt.client as mqtt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion

from device_agent.wire import client as client_module
from device_agent.wire.client import LeanClient


class Trickle:
    """A non-blocking socket handing out ``data`` in ``pieces``, with nothing to read between two pieces."""

    def __init__(self, data: bytes, pieces: list[int], per_call: int = 2**31) -> None:
        self.data, self.at, self.piece_ends, self.starved, self.per_call = data, 0, [], False, per_call
        for size in pieces:
            self.piece_ends.append(min(len(data), (self.piece_ends or [0])[-1] + size))
        self.piece_ends.append(len(data))

    def _take(self, most: int) -> bytes:
        while self.piece_ends and self.piece_ends[0] <= self.at:
            self.piece_ends.pop(0)
            if self.at < len(self.data) and not self.starved:
                self.starved = True
                raise BlockingIOError
        self.starved = False
        end = min(self.piece_ends[0] if self.piece_ends else len(self.data), self.at + min(most, self.per_call))
        taken, self.at = self.data[self.at : end], end
        return taken  # b"" once everything was read: the broker closed the connection

    def recv(self, most: int) -> bytes:
        return self._take(most)

    def recv_into(self, view: memoryview) -> int:
        taken = self._take(len(view))
        view[: len(taken)] = taken
        return len(taken)

    def close(self) -> None:
        self.at = len(self.data)


def packet(command: int, body: bytes) -> bytes:
    length, remaining = bytearray(), len(body)
    while True:
        byte, remaining = remaining % 128, remaining // 128
        length.append(byte | (128 if remaining else 0))
        if not remaining:
            return bytes([command]) + bytes(length) + body


def read_all(
    kind: type[mqtt.Client], stream: bytes, pieces: list[int], per_call: int = 2**31
) -> tuple[list[tuple[int, bytes]], list[int]]:
    """Every packet the client handles, and what each call of its reader returned, until the stream ends."""
    client = kind(CallbackAPIVersion.VERSION2, client_id="read-test", protocol=MQTTProtocolVersion.MQTTv5)
    handled: list[tuple[int, bytes]] = []

    def handle() -> mqtt.MQTTErrorCode:
        handled.append((client._in_packet["command"], bytes(client._in_packet["packet"])))
        return mqtt.MQTTErrorCode.MQTT_ERR_SUCCESS

    client._packet_handle = handle
    client._sock = Trickle(stream, pieces, per_call)
    returned: list[int] = []
    while not returned or returned[-1] != mqtt.MQTTErrorCode.MQTT_ERR_CONN_LOST:
        returned.append(client._packet_read())
        assert len(returned) < 10_000
    return handled, returned


packets = st.lists(
    st.tuples(
        st.sampled_from([0x30, 0x32, 0x3B, 0x40, 0xD0]),
        st.one_of(st.binary(max_size=200), st.integers(0, 40_000).map(lambda n: bytes(range(256)) * (n // 256))),
    ),
    min_size=1,
    max_size=6,
)


@pytest.mark.parametrize("preallocate", [client_module._PREALLOCATE, 300], ids=["whole-body", "past-the-limit-too"])
@settings(max_examples=150, deadline=None)
@given(packets=packets, pieces=st.lists(st.integers(1, 70_000), max_size=12))
def test_packets_read_in_any_pieces_are_what_paho_reads(packets, pieces, preallocate):
    stream = b"".join(packet(command, body) for command, body in packets)
    with patch.object(client_module, "_PREALLOCATE", preallocate):
        ours = read_all(LeanClient, stream, pieces)
    assert ours == read_all(mqtt.Client, stream, pieces)
    assert ours[0] == packets


def test_a_remaining_length_of_more_than_four_bytes_is_a_protocol_error_as_in_paho():
    stream = bytes([0x30, 0xFF, 0xFF, 0xFF, 0xFF, 0x7F])
    ours = read_all(LeanClient, stream, [])
    assert ours[1][0] == mqtt.MQTTErrorCode.MQTT_ERR_PROTOCOL
    assert ours[1][0] == read_all(mqtt.Client, stream, [])[1][0]


def test_a_body_arriving_a_byte_at_a_time_gives_the_loop_back_after_100_reads_as_in_paho():
    stream = packet(0x30, bytes(250))
    handled, returned = read_all(LeanClient, stream, [], per_call=1)
    assert returned.count(mqtt.MQTTErrorCode.MQTT_ERR_AGAIN) == 2
    assert (handled, returned) == read_all(mqtt.Client, stream, [], per_call=1)
