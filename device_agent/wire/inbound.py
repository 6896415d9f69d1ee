"""Reading one inbound frame: the guard's admission, the parse, and what a dropped frame is answered with.

A receiver facing untrusted peers (the coordinator) charges every frame to its device and checks its topic
before any state is kept; a malformed message is logged and dropped, a peer of another protocol version is
told to stop (once per burst), and a message published retained that should not be is cleared.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import paho.mqtt.client as mqtt

from device_agent.wire import topics
from device_agent.wire.engine.frames import is_chunk_frame
from device_agent.wire.guard import RETAINED_KINDS, InboundGuard
from device_agent.wire.messages import Message, ProtocolError, VersionMismatch, encode, incompatible, parse_message
from device_agent.wire.settings import SessionStats

log = logging.getLogger("fedfleet.wire")

ChunkFrame = bytes | bytearray | memoryview
"""A chunk frame as the client read it (``LeanClient`` hands over views, not copies)."""


class Inbound:
    """Turns a received MQTT message into a chunk frame or a control message to act on, or drops it.

    ``publish(topic, data, retain)`` is the session's carrier; ``tell(topic, message)`` hands a message to the
    session's owner (an ``incompatible`` answer sent to a peer is told too).
    """

    def __init__(
        self,
        name: str,
        stats: SessionStats,
        publish: Callable[[str, bytes, bool], None],
        tell: Callable[[str, Message], None],
        guard: InboundGuard | None = None,
    ) -> None:
        self._name = name
        self._stats = stats
        self._publish = publish
        self._tell = tell
        self._guard = guard

    def read(self, msg: mqtt.MQTTMessage, now: float) -> ChunkFrame | Message | None:
        """The chunk frame or parsed message to act on; None when it was dropped."""
        data, guard = msg.payload, self._guard
        peer = topics.device_of(msg.topic) or msg.topic
        if guard is not None:
            # Every frame costs its device a token and must be on a documented topic, before any state is kept.
            admitted = guard.admit_frame(msg.topic, is_chunk_frame(data), now)
            if admitted is None:
                return None
            peer = admitted
        self._stats.bytes_in[msg.topic] = self._stats.bytes_in.get(msg.topic, 0) + len(data)
        if guard is None:
            return self._parse(msg.topic, data, peer, now)
        if not data:
            return None  # a retained message being cleared (see below)
        message = self._parse(msg.topic, data, peer, now)
        if message is None or guard.admit_message(
            peer, None if isinstance(message, ChunkFrame) else message, msg.retain, now
        ):
            return message
        if msg.retain and (isinstance(message, ChunkFrame) or not isinstance(message, RETAINED_KINDS)):
            self._publish(msg.topic, b"", True)  # clear it: no later subscriber gets it either
        return None

    def _parse(self, topic: str, data: ChunkFrame, peer: str, now: float) -> ChunkFrame | Message | None:
        if is_chunk_frame(data):
            return data
        try:
            return parse_message(data)
        except ProtocolError as exc:
            self.reject(topic, peer, exc, now)
            return None

    def reject(self, topic: str, peer: str, exc: ProtocolError, now: float) -> None:
        """Drop a malformed message; tell a peer of another protocol version to stop (once per burst)."""
        self._stats.rejected += 1
        wrong_version = isinstance(exc, VersionMismatch)
        first = True
        if self._guard is not None:
            reason = "wrong_version" if wrong_version else "malformed"
            first = self._guard.refuse_first(peer, reason, f"on {topic}: {exc}", now)
        else:
            log.warning("%s: rejected a message on %s: %s", self._name, topic, exc)
        if isinstance(exc, VersionMismatch) and first:
            answer = incompatible(exc.version)
            try:
                self._publish(topics.reply_topic(topic), encode(answer), False)
            except ValueError:
                return  # not a device topic: nobody to answer
            self._tell(topic, answer)
