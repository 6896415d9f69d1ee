"""paho's MQTT client, leaner on the paths every session runs all day.

It overrides paho-mqtt 2.x internals (``_packet_read``, ``_packet_queue``, ``_handle_publish``, ``_thread_main``,
and it reads ``_in_packet``, ``_out_packet``, ``_manual_ack``): pyproject pins ``paho-mqtt>=2.0,<2.3``, and
tests/device_agent/wire/test_publish_decode.py and test_packet_read.py check it against paho's own code.
"""

from __future__ import annotations

import copy
import ssl
import struct
import threading
import time

import paho.mqtt.client as mqtt
from paho.mqtt.enums import MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import MQTTException, Properties, VariableByteIntegers

_NO_PUBLISH_PROPERTIES = Properties(PacketTypes.PUBLISH)
_PREALLOCATE = 16 * 2**20
"""Largest packet body received into a buffer allocated whole up front; a larger one grows as it arrives."""


class LeanClient(mqtt.Client):
    """paho's client with the overrides below (paho-mqtt 2.x internals).

    - its network thread sleeps up to ``idle_s`` between packets (``loop_start``'s: 1 s). The thread wakes
      on every packet and on every publish from another thread (paho's socket pair), so the timeout only
      paces the keepalive check. At 1,000 emulated devices on 2 cores, the 1 s wake-ups of idle connections
      took more CPU than the devices' MQTT traffic;
    - a QoS 1 PUBLISH is decoded without copying its payload: the message carries a read-only view of the
      packet buffer that paho reads into and then drops (it starts a fresh one for the next packet). paho's
      own decoder copies a 256 KiB chunk frame four times; on a coordinator taking uploads from many devices
      at once, its decoder held about half of the network thread's time with the GIL (py-spy). Anything else
      (QoS 0 or 2, a packet too short to decode) goes through paho's decoder, which also reports malformed
      packets its own way. A PUBLISH without properties (every one fedfleet sends) gets a copy of an empty
      ``Properties`` instead of a fresh one unpacked: paho builds its tables of property names per instance;
    - a packet's body is received straight into a buffer of its size (``recv_into``): paho receives it piece by
      piece and appends each piece to a growing buffer, a second copy of every byte received;
    - a packet queued on the network thread itself (the PUBACK of each inbound PUBLISH) does not wake that
      thread through paho's socket pair: it goes out on the loop's next turn, which selects for writing
      while packets wait. paho's wake-up cost each inbound chunk a send, a select and a recv.
    """

    idle_s = 1.0

    def _thread_main(self) -> None:  # the target of paho's loop_start (paho-mqtt 2.x), as paho writes it
        try:
            self.loop_forever(timeout=self.idle_s, retry_first_connection=True)
        finally:
            self._thread = None

    def _packet_queue(
        self, command: int, packet: bytes | bytearray, mid: int, qos: int, info: mqtt.MQTTMessageInfo | None = None
    ) -> mqtt.MQTTErrorCode:  # paho's queue of outgoing packets (paho-mqtt 2.x)
        if self._thread is None or threading.current_thread() is not self._thread:
            return super()._packet_queue(command, packet, mid, qos, info)
        self._out_packet.append(
            {
                "command": command,
                "mid": mid,
                "qos": qos,
                "pos": 0,
                "to_process": len(packet),
                "packet": packet,
                "info": info,
            }
        )
        return mqtt.MQTTErrorCode.MQTT_ERR_SUCCESS

    def _packet_read(self) -> mqtt.MQTTErrorCode:  # paho's reader of inbound packets (paho-mqtt 2.x)
        state = self._in_packet
        if not hasattr(self._sock, "recv_into") or (
            state["have_remaining"] and len(state["packet"]) != state["remaining_length"]
        ):
            return super()._packet_read()  # a socket without recv_into, or a body past _PREALLOCATE
        try:
            while not state["have_remaining"]:
                byte = self._sock_recv(1)
                if not byte:
                    return mqtt.MQTTErrorCode.MQTT_ERR_CONN_LOST
                if state["command"] == 0:
                    state["command"] = byte[0]
                    continue
                state["remaining_count"].append(byte[0])
                if len(state["remaining_count"]) > 4:
                    return mqtt.MQTTErrorCode.MQTT_ERR_PROTOCOL
                state["remaining_length"] += (byte[0] & 127) * state["remaining_mult"]
                state["remaining_mult"] *= 128
                if not byte[0] & 128:
                    state["have_remaining"] = 1
                    state["to_process"] = state["remaining_length"]
                    if state["remaining_length"] > _PREALLOCATE:
                        return super()._packet_read()
                    state["packet"] = bytearray(state["remaining_length"])
            with memoryview(state["packet"]) as body:
                for _ in range(100):  # as paho: a huge packet does not hold the loop
                    if not state["to_process"]:
                        break
                    received = self._sock_recv_into(body[len(body) - state["to_process"] :])
                    if not received:
                        return mqtt.MQTTErrorCode.MQTT_ERR_CONN_LOST
                    state["to_process"] -= received
                    with self._msgtime_mutex:
                        self._last_bytes_received = time.monotonic()
            if state["to_process"]:
                return mqtt.MQTTErrorCode.MQTT_ERR_AGAIN
        except BlockingIOError:
            return mqtt.MQTTErrorCode.MQTT_ERR_AGAIN
        except OSError as err:
            self._easy_log(mqtt.MQTT_LOG_ERR, "failed to receive on socket: %s", err)
            return mqtt.MQTTErrorCode.MQTT_ERR_CONN_LOST
        return self._handle_read_packet()

    def _handle_read_packet(self) -> mqtt.MQTTErrorCode:
        """The end of paho's ``_packet_read``: handle the whole packet, then start the next one afresh."""
        self._in_packet["pos"] = 0
        try:
            rc = self._packet_handle()
        except mqtt.MalformedPacket as exc:
            self._easy_log(mqtt.MQTT_LOG_DEBUG, "Received malformed packet: %s", exc)
            rc = mqtt.MQTTErrorCode.MQTT_ERR_PROTOCOL
        self._in_packet = {
            "command": 0,
            "have_remaining": 0,
            "remaining_count": [],
            "remaining_mult": 1,
            "remaining_length": 0,
            "packet": bytearray(),
            "to_process": 0,
            "pos": 0,
        }
        with self._msgtime_mutex:
            self._last_bytes_received = time.monotonic()
        return rc

    def _sock_recv_into(self, view: memoryview) -> int:
        """paho's ``_sock_recv``, into ``view``."""
        if self._sock is None:
            raise ConnectionError("self._sock is None")
        try:
            return self._sock.recv_into(view)
        except ssl.SSLWantReadError as err:
            raise BlockingIOError() from err
        except ssl.SSLWantWriteError as err:
            self._call_socket_register_write()
            raise BlockingIOError() from err

    def _handle_publish(self) -> mqtt.MQTTErrorCode:  # paho's handler of an inbound PUBLISH (paho-mqtt 2.x)
        message = self._qos1_message(self._in_packet["command"], self._in_packet["packet"])
        if message is None:
            return super()._handle_publish()
        self._handle_on_message(message)
        return mqtt.MQTTErrorCode.MQTT_ERR_SUCCESS if self._manual_ack else self._send_puback(message.mid)

    def _qos1_message(self, header: int, packet: bytearray) -> mqtt.MQTTMessage | None:
        """The message of a QoS 1 PUBLISH whose payload is a view of ``packet``; None for paho's decoder."""
        if (header & 0x06) >> 1 != 1:
            return None
        view = memoryview(packet).toreadonly()
        topic_end = 2 + int.from_bytes(view[:2], "big")
        start = topic_end + 2
        if len(view) < start:
            return None
        message = mqtt.MQTTMessage(mid=int.from_bytes(view[topic_end:start], "big"), topic=bytes(view[2:topic_end]))
        message.dup, message.qos, message.retain = bool(header & 0x08), 1, bool(header & 0x01)
        if self._protocol == MQTTProtocolVersion.MQTTv5:
            try:
                length, length_size = VariableByteIntegers.decode(view[start : start + 4])
                message.properties = copy.copy(_NO_PUBLISH_PROPERTIES)
                start += length_size + length
                if len(view) < start:
                    return None
                if length:
                    message.properties.unpack(bytes(view[start - length_size - length : start]))
            except (MQTTException, ValueError, IndexError, KeyError, struct.error):
                return None
        message.payload = view[start:]
        message.timestamp = time.monotonic()
        return message
