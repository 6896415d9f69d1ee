"""One MQTT session speaking the wire protocol: the thin join of the transfer engine and its MQTT carrier.

What it guarantees on top of paho (the parts live in the modules named):

- a persistent MQTT session with a fixed client id, a last will and reconnects with backoff, every paho
  callback guarded (``connection``, over ``client.LeanClient``);
- payloads go out as verified chunked transfers, kept by the sans-IO transfer engine (``engine``): frames in,
  frames and events out. After every reconnect unfinished transfers are resumed: senders re-announce,
  receivers nack what they lack. Nothing relies on the broker keeping messages for an offline client;
- every size is checked before publishing, since paho ignores the broker's maximum packet size, and chunk
  frames in flight are bounded (the engine's window, held until each PUBACK: ``window``);
- a malformed or unknown-version message is logged and dropped; the session carries on. A receiver facing
  untrusted peers admits every frame through its ``guard`` first (``inbound``).

The join maps topics to the engine's routes (the topic a peer is answered on: ``topics.answered_on``), calls
the engine under one lock and publishes what it returns outside it. Callbacks given by the user run on one
dispatcher thread (``timer``), never on paho's network thread, so a slow or failing handler cannot stall or
kill the connection. Inbound frames are decoded and parsed on paho's network thread; each chunk is then
verified on the process's hashing pool (``hashing``, ``receiving``) and filed into the engine there while
that thread reads the next frame. The pool bounds the bytes waiting for it: past the bound paho's thread
stops reading and TCP pushes back on the broker, which is what a receiver that cannot keep up should do; a
link hook (``after_chunk_in``) that sleeps slows the reading the same way.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import paho.mqtt.client as mqtt

from device_agent.wire import topics
from device_agent.wire.address import BrokerAddress
from device_agent.wire.carrier import ChunkHook, MqttCarrier
from device_agent.wire.connection import LoginRefused
from device_agent.wire.delivery import Delivery
from device_agent.wire.engine import NOTHING, Outputs
from device_agent.wire.engine.receivers import Receivers
from device_agent.wire.guard import InboundGuard
from device_agent.wire.inbound import ChunkFrame, Inbound
from device_agent.wire.join import EngineJoin, MessageHandler, PayloadHandler
from device_agent.wire.messages import Ack, Error, Manifest, Message, Nack, Status, encode
from device_agent.wire.receiving import ChunkIntake
from device_agent.wire.settings import SessionConfig, SessionStats
from device_agent.wire.topics import answered_on

__all__ = [
    "BrokerAddress",
    "Delivery",
    "LoginRefused",
    "Session",
    "SessionConfig",
    "SessionStats",
    "coordinator_session",
    "device_session",
]

log = logging.getLogger("fedfleet.wire")


class Session(EngineJoin):
    """A persistent MQTT session that sends and receives messages and verified payloads.

    ``subscriptions`` are (re)subscribed on every connect. ``on_message(topic, message)`` gets
    every valid control message except the transfer machinery's own (manifest/ack/nack);
    ``on_payload(topic, completed)`` gets every complete, verified payload exactly once.
    ``will`` is published by the broker if this client vanishes without a clean ``stop``.
    ``before_chunk_out(n)`` runs before each outgoing chunk frame of ``n`` bytes is published (first
    sends and repairs alike), ``after_chunk_in(n)`` after each inbound chunk frame is read (on paho's thread,
    which then reads no more until it returns, as a slow downlink would); both may block, so a token bucket
    behind them shapes the link chunk by chunk (emulated devices).
    ``guard`` (a receiver facing untrusted peers: the coordinator) admits inbound frames per peer first;
    its limits bound the receiver's transfers too.
    """

    def __init__(
        self,
        config: SessionConfig,
        subscriptions: list[str],
        on_message: MessageHandler | None = None,
        on_payload: PayloadHandler | None = None,
        will: tuple[str, Message] | None = None,
        before_chunk_out: ChunkHook | None = None,
        after_chunk_in: ChunkHook | None = None,
        guard: InboundGuard | None = None,
    ) -> None:
        name = config.client_id
        super().__init__(name, config, topics.device_of, guard, on_message, on_payload)
        self.config = config
        self._after_chunk_in = after_chunk_in
        self.carrier = MqttCarrier(
            config,
            self.engine,
            self.timer.due,
            subscriptions,
            will,
            self._on_connected,
            self._handle_message,
            before_chunk_out,
        )
        self.connection, self.window, self.stats = self.carrier.connection, self.carrier.window, self.carrier.stats
        self.intake = ChunkIntake(name, self._file_chunk, guard)
        self.inbound = Inbound(name, self.stats, lambda t, d, r: self._publish(t, d, retain=r), self._tell, guard)
        self._threads: list[threading.Thread] = []

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self, timeout: float | None = 10.0) -> Session:
        """Connect (retrying with backoff in the background) and wait up to ``timeout`` s for the first connection.

        ``timeout=None`` returns at once; the session keeps trying to connect either way, except after
        :attr:`refused` credentials: then ``start`` raises :class:`LoginRefused` (with a timeout) and
        the session stops trying.
        """
        self.connection.start()
        stopping = self.connection.stopping
        for target, name in (
            (self.dispatcher.run, "dispatch"),
            (lambda: self.timer.run(stopping), "tick"),
        ):
            thread = threading.Thread(target=target, name=f"fedfleet-{name}-{self.config.client_id}", daemon=True)
            thread.start()
            self._threads.append(thread)
        if timeout is not None:
            try:
                self.connection.wait_first(timeout)
            except ConnectionError:
                self.stop()
                raise
        return self

    def stop(self, settle_s: float = 1.0) -> None:
        """Disconnect cleanly (the broker then discards the will) once what was published is acknowledged, or
        ``settle_s`` passed (``MqttCarrier.drain``), and stop every thread."""
        self.connection.stopping.set()
        self.intake.stopping.set()
        self.timer.due.set()
        self.carrier.drain(settle_s)
        self.connection.stop()
        self.dispatcher.close()
        for thread in self._threads:
            thread.join(timeout=5)
        self._threads.clear()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    @property
    def connected(self) -> bool:
        return self.carrier.connected

    @property
    def refused(self) -> str | None:
        """Why the broker refused this client's login, once it has; the session then stops reconnecting."""
        return self.connection.refused

    @property
    def connect_failure(self) -> str | None:
        """Why the last attempt to connect failed (unreachable, TLS handshake...), said once per outage."""
        return self.connection.connect_failure

    @property
    def in_window(self) -> int:
        """Bytes of chunk frames handed to paho and not yet confirmed by the broker."""
        return self.window.in_window

    @property
    def receivers(self) -> Receivers:
        """The engine's incoming transfers, per route a peer is answered on."""
        return self.engine.receivers

    def receiving(self) -> list[str]:
        """Ids of inbound transfers started but not yet complete."""
        with self._lock:
            return self.engine.receivers.receiving()

    def wait_connected(self, timeout: float) -> bool:
        return self.connection.connected.wait(timeout)

    # ---- sending ---------------------------------------------------------------------------

    def publish(self, topic: str, message: Message, retain: bool = False) -> None:
        """Publish one control message at QoS 1 (queued by paho while disconnected)."""
        self._publish(topic, encode(message), retain=retain)

    def retract(self, topic: str) -> None:
        """Clear ``topic``'s retained message (an empty retained publish): later subscribers get none."""
        self._publish(topic, b"", retain=True)

    # ---- the carrier: every frame leaves through _publish ------------------------------------

    def _pump(self, retry: bool = True) -> None:
        self.window.pump(self._publish_windowed, retry)

    def _publish_windowed(self, topic: str, frame: bytes, transfer: str | None) -> None:
        self._publish(topic, frame, transfer=transfer, windowed=True)

    def _emit(self, route: str, data: bytes, transfer: str | None) -> None:
        self._publish(route, data, transfer=transfer)

    def _carrying(self) -> bool:
        return self.connected

    def _publish(
        self, topic: str, data: bytes, retain: bool = False, transfer: str | None = None, windowed: bool = False
    ) -> None:
        # Never called with self._lock held (see there) nor the window's.
        self.carrier.publish(topic, data, retain, transfer, windowed)

    # ---- the join: chunks and manifests into the engine ---------------------------------------

    def _file_chunk(
        self, topic: str, transfer: str, index: int, chunk: memoryview, digest: bytes, now: float, intact: bool
    ) -> None:
        """One verified chunk into the engine (on a hashing thread, see ``receiving``)."""
        with self._lock:
            outputs = self.engine.receivers.on_chunk(answered_on(topic), transfer, index, chunk, digest, now, intact)
        if outputs:
            self._apply(outputs, topic)

    def _take_manifest(self, topic: str, manifest: Manifest, now: float) -> None:
        """Start, seal or resume a transfer once its chunks read before the manifest are filed."""
        self.intake.await_chunks(manifest.transfer)
        with self._lock:
            outputs = self.engine.on_manifest(answered_on(topic), manifest, now)
            woke = self.timer.idle and self.engine.busy()
        if woke:
            self.timer.wake()
        self._apply(outputs, topic)

    # ---- paho callbacks (network thread) ---------------------------------------------------

    def _on_connected(self, flags: Any) -> None:
        with self._lock:
            frames = self.engine.resume(time.monotonic())
        self._apply(frames)
        log.info(
            "%s: connected to %s (session present: %s, %d transfers resumed)",
            self.config.client_id,
            self.config.broker.url,
            flags.session_present,
            len(frames),
        )

    def _handle_message(self, msg: mqtt.MQTTMessage) -> None:
        now = time.monotonic()
        message = self.inbound.read(msg, now)
        if isinstance(message, ChunkFrame):
            if not self.intake.take_chunk(msg.topic, message, now):
                self.stats.rejected += 1
            elif self._after_chunk_in is not None:
                self._after_chunk_in(len(message))
            return
        outputs: Outputs = NOTHING
        if isinstance(message, Manifest):
            self._take_manifest(msg.topic, message, now)
        elif isinstance(message, Ack | Nack):
            with self._lock:
                outputs = self.engine.on_answer(answered_on(msg.topic), message, now)
        elif message is not None:
            if isinstance(message, Error):
                with self._lock:
                    outputs = self.engine.on_error(message)
            self._tell(msg.topic, message)
        self._apply(outputs, msg.topic)


def device_session(
    fleet: str,
    device: str,
    broker: BrokerAddress,
    on_message: MessageHandler | None = None,
    on_payload: PayloadHandler | None = None,
    before_chunk_out: ChunkHook | None = None,
    after_chunk_in: ChunkHook | None = None,
    **config: Any,
) -> tuple[Session, topics.DeviceTopics]:
    """A device's session: its fixed client id, its ``down`` subscription, an ``offline`` last will.

    The broker user name must be the device name: that is what the ACL patterns confine.
    """
    t = topics.DeviceTopics(fleet, device)
    session = Session(
        SessionConfig(client_id=f"fedfleet-{fleet}-{device}", broker=broker, **config),
        subscriptions=[t.down],
        on_message=on_message,
        on_payload=on_payload,
        will=(t.status, Status(device=device, state="offline", detail="connection lost")),
        before_chunk_out=before_chunk_out,
        after_chunk_in=after_chunk_in,
    )
    return session, t


def coordinator_session(
    fleet: str,
    broker: BrokerAddress,
    on_message: MessageHandler | None = None,
    on_payload: PayloadHandler | None = None,
    guard: InboundGuard | None = None,
    **config: Any,
) -> Session:
    """The coordinator's session: one fixed client id per fleet, subscribed to every device's ``up``.

    Devices are not trusted: everything they send passes ``guard`` (default limits if not given).
    """
    client_id = f"fedfleet-{fleet}-coordinator"
    return Session(
        SessionConfig(client_id=client_id, broker=broker, **config),
        subscriptions=[topics.fleet_uplinks(fleet)],
        on_message=on_message,
        on_payload=on_payload,
        guard=guard if guard is not None else InboundGuard(name=client_id),
    )
