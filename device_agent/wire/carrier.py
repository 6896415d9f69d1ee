"""The MQTT carrier of a session: frames onto the broker and back, knowing nothing of transfers.

It holds the paho client (``connection``: ``LeanClient``, persistent session, last will, reconnect backoff),
renews the subscriptions on every connect, checks every publish against the broker's maximum packet size (paho
does not), lets the link hook shape each outgoing chunk frame, counts bytes per topic, and holds each windowed
frame's bytes until the broker's PUBACK of its message id (``window``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import paho.mqtt.client as mqtt

from device_agent.wire.connection import Connection
from device_agent.wire.engine import TransferEngine
from device_agent.wire.engine.frames import is_chunk_frame
from device_agent.wire.engine.manifests import check_packet
from device_agent.wire.messages import Message
from device_agent.wire.settings import SessionConfig, SessionStats
from device_agent.wire.window import SendWindow

log = logging.getLogger("fedfleet.wire")

# Told the size of each chunk frame (bytes on the wire); may block, which is how a link is shaped.
ChunkHook = Callable[[int], object]


class MqttCarrier:
    """One MQTT connection carrying ``engine``'s frames.

    ``on_connected()`` runs on paho's thread after every connect, once the subscriptions are renewed (the join
    resumes its transfers there); ``on_message(msg)`` gets every inbound MQTT message. ``room`` is set when the
    window makes room for frames that wait.
    """

    def __init__(
        self,
        config: SessionConfig,
        engine: TransferEngine,
        room: threading.Event,
        subscriptions: list[str],
        will: tuple[str, Message] | None,
        on_connected: Callable[[Any], None],
        on_message: Callable[[mqtt.MQTTMessage], None],
        before_chunk_out: ChunkHook | None = None,
    ) -> None:
        self.config = config
        self.stats = SessionStats()
        self.window = SendWindow(engine, room)
        self._touch = engine.senders.touch
        self._subscriptions = list(subscriptions)
        self._on_connected = on_connected
        self._before_chunk_out = before_chunk_out
        self._mids: dict[int, str] = {}
        self.connection = Connection(config, will, self._connected, on_message, self._handle_publish)

    @property
    def connected(self) -> bool:
        return self.connection.connected.is_set()

    def publish(
        self, topic: str, data: bytes, retain: bool = False, transfer: str | None = None, windowed: bool = False
    ) -> None:
        """Publish one frame at QoS 1 (queued by paho while disconnected); ``transfer``: the outgoing transfer it
        belongs to, ``windowed``: its bytes count in the window until the broker confirms it."""
        try:
            check_packet(self.config.limits, len(data), "message")
            if self._before_chunk_out is not None and transfer is not None and is_chunk_frame(data):
                self._before_chunk_out(len(data))
            self.stats.bytes_out[topic] = self.stats.bytes_out.get(topic, 0) + len(data)
            info = self.connection.client.publish(topic, data, qos=1, retain=retain)
        except BaseException:
            if windowed:
                self.window.settle(len(data))
            raise
        if transfer is not None and info.mid:
            self._mids[info.mid] = transfer
        self.window.handed(info.mid, len(data) if windowed else 0)

    def drain(self, settle_s: float) -> None:
        """Wait up to ``settle_s`` for the broker to acknowledge what was published.

        A DISCONNECT sent while a PUBLISH was unacknowledged closed the socket under the broker's PUBACK, and
        mosquitto, failing that write before it read the DISCONNECT, published the will after a clean stop
        (8 of 30 stops right after a retained status, 0 of 60 since).
        """
        deadline = time.monotonic() + settle_s
        while self.connected and self.window.unacknowledged() and time.monotonic() < deadline:
            time.sleep(0.01)

    def _connected(self, client: mqtt.Client, flags: Any) -> None:
        self.stats.connects += 1
        for topic in self._subscriptions:
            client.subscribe(topic, qos=1)
        self._on_connected(flags)

    def _handle_publish(self, mid: int, reason: Any) -> None:
        transfer = self._mids.pop(mid, None)
        self.window.confirmed(mid)
        if reason.is_failure:
            self.stats.publish_denied += 1
            log.warning("%s: broker refused a publish: %s", self.config.client_id, reason)
            return
        self.stats.published += 1
        if transfer is not None:
            self._touch(transfer, time.monotonic())  # lock-free (see Senders.touch)
