"""One MQTT session speaking the wire protocol: the thin join of a connection, the transfers and the threads.

What it guarantees on top of paho (the parts live in the modules named):

- a persistent MQTT session with a fixed client id, a last will and reconnects with backoff, every paho
  callback guarded (``connection``);
- payloads go out as verified chunked transfers (``transfer``); after every reconnect unfinished transfers are
  resumed: senders re-announce (``sending``), receivers nack what they lack (``receiving``). Nothing relies on
  the broker keeping messages for an offline client;
- every size is checked before publishing, since paho ignores the broker's maximum packet size, and chunk
  frames in flight are bounded (``window``);
- a malformed or unknown-version message is logged and dropped; the session carries on. A receiver facing
  untrusted peers admits every frame through its ``guard`` first.

Callbacks given by the user run on one dispatcher thread (``timer``), never on paho's network thread, so a slow
or failing handler cannot stall or kill the connection. Inbound frames are decoded and parsed on paho's network
thread; each chunk is then verified and filed on the process's hashing pool (``hashing``, ``receiving``) while
that thread reads the next frame. The pool bounds the bytes waiting for it: past the bound paho's thread stops
reading and TCP pushes back on the broker, which is what a receiver that cannot keep up should do; a link hook
(``after_chunk_in``) that sleeps slows the reading the same way.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import paho.mqtt.client as mqtt

from device_agent.wire import topics
from device_agent.wire.address import BrokerAddress
from device_agent.wire.connection import Connection, LoginRefused
from device_agent.wire.delivery import Delivery
from device_agent.wire.guard import InboundGuard
from device_agent.wire.hashing import shared_pool
from device_agent.wire.inbound import ChunkFrame, Inbound
from device_agent.wire.messages import (
    Ack,
    Error,
    Manifest,
    Message,
    Nack,
    Status,
    encode,
)
from device_agent.wire.receiving import Receivers
from device_agent.wire.sending import Frames, Senders, check_packet, prepare
from device_agent.wire.settings import SessionConfig, SessionStats
from device_agent.wire.timer import Dispatcher, Timer
from device_agent.wire.transfer import Completed, is_chunk_frame
from device_agent.wire.window import SendWindow

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

MessageHandler = Callable[[str, Message], None]
PayloadHandler = Callable[[str, Completed], None]
# Told the size of each chunk frame (bytes on the wire); may block, which is how a link is shaped.
ChunkHook = Callable[[int], object]


class Session:
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
        self.config = config
        self.stats = SessionStats()
        self._guard_in = guard
        self._subscriptions = list(subscriptions)
        self._on_message = on_message
        self._on_payload = on_payload
        self._before_chunk_out = before_chunk_out
        self._after_chunk_in = after_chunk_in
        self._lock = threading.RLock()
        """Guards the senders' and receivers' transfers; never held while publishing (paho holds its own lock
        while it runs on_publish, which takes it)."""
        self._mids: dict[int, str] = {}
        self._hashing = shared_pool()
        self.dispatcher = Dispatcher(name)
        self.senders = Senders(name, self._lock, guard)
        self.timer = Timer(
            name,
            config.tick_s,
            self._lock,
            busy=lambda: bool(self.senders) or bool(self.receivers),
            pump=lambda: self._pump(retry=False),
            tick=lambda now: self._tick(now),
        )
        self.window = SendWindow(config.send_window_bytes, self.timer.due)
        self.receivers = Receivers(
            name,
            self._lock,
            config.nack_after_s,
            reply=self._reply,
            deliver=self._deliver_payload,
            idle=lambda: self.timer.idle,
            wake=self.timer.wake,
            guard=guard,
        )
        self.inbound = Inbound(name, self.stats, lambda t, d, r: self._publish(t, d, retain=r), self._tell, guard)
        self.connection = Connection(config, will, self._on_connected, self._handle_message, self._handle_publish)
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
        """Disconnect cleanly (the broker then discards the will) and stop every thread.

        Waits up to ``settle_s`` for the broker to acknowledge what was published: a DISCONNECT sent while a
        PUBLISH was unacknowledged closed the socket under the broker's PUBACK, and mosquitto, failing that
        write before it read the DISCONNECT, published the will after a clean stop (8 of 30 stops right after
        a retained status, 0 of 60 since).
        """
        self.connection.stopping.set()
        self.receivers.stopping.set()
        self.timer.due.set()
        deadline = time.monotonic() + settle_s
        while self.connected and self.window.unacknowledged() and time.monotonic() < deadline:
            time.sleep(0.01)
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
        return self.connection.connected.is_set()

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

    def receiving(self) -> list[str]:
        """Ids of inbound transfers started but not yet complete."""
        return self.receivers.receiving()

    def wait_connected(self, timeout: float) -> bool:
        return self.connection.connected.wait(timeout)

    # ---- sending ---------------------------------------------------------------------------

    def publish(self, topic: str, message: Message, retain: bool = False) -> None:
        """Publish one control message at QoS 1 (queued by paho while disconnected)."""
        self._publish(topic, encode(message), retain=retain)

    def retract(self, topic: str) -> None:
        """Clear ``topic``'s retained message (an empty retained publish): later subscribers get none."""
        self._publish(topic, b"", retain=True)

    def send(self, topic: str, payload: bytes, manifest: Manifest | None = None, **manifest_fields: Any) -> Delivery:
        """Start a verified chunked transfer of ``payload`` to ``topic``; refuse it now if it breaks a limit.

        Pass a ``manifest`` from ``make_manifest`` to send the same bytes to several receivers without
        rehashing (each send gets a fresh transfer id, unless ``transfer=`` names the one a signature
        binds); otherwise ``payload`` is announced with ``manifest_fields`` and hashed chunk by chunk
        as it is published.
        """
        outgoing = prepare(self.config, payload, manifest, **manifest_fields)
        delivery = self.senders.add(topic, outgoing)
        self.window.enqueue(topic, outgoing.transfer, outgoing.start(self._hashing))
        self.timer.wake()
        self._pump()
        return delivery

    def cancel(self, stale: Callable[[Manifest], bool], why: str) -> int:
        """Stop sending every outgoing transfer whose manifest is ``stale`` (no more chunks, re-announcements
        or repairs); their deliveries fail with ``why``. How many were cancelled."""
        return self.senders.cancel(stale, why)

    def refuse(self, stale: Callable[[Manifest], bool], why: str) -> int:
        """From now on answer every new inbound transfer whose manifest is ``stale`` with an error saying ``why``,
        before any of its chunks is kept, and drop the unfinished ones already open (replaces the last rule).
        How many unfinished transfers were dropped."""
        return self.receivers.refuse(stale, why)

    # ---- the carrier: every frame leaves through _publish ------------------------------------

    def _pump(self, retry: bool = True) -> None:
        self.window.pump(self._publish_windowed, self.senders.__contains__, retry)

    def _publish_windowed(self, topic: str, frame: bytes, transfer: str) -> None:
        self._publish(topic, frame, transfer=transfer, windowed=True)

    def _publish(
        self, topic: str, data: bytes, retain: bool = False, transfer: str | None = None, windowed: bool = False
    ) -> None:
        # Never called with self._lock held (see there) nor the window's.
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

    def _publish_frames(self, frames: Frames) -> None:
        for topic, transfer, data in frames:
            if transfer is not None and transfer not in self.senders:
                continue  # cancelled, refused or failed on the way: its frames would only be dropped
            self._publish(topic, data, transfer=transfer)

    def _reply(self, topic: str, replies: list[Message]) -> None:
        for reply in replies:
            self._publish(topics.reply_topic(topic), encode(reply))

    def _deliver_payload(self, topic: str, completed: Completed) -> None:
        if self._on_payload is not None:
            handler = self._on_payload
            self.dispatcher.put(lambda: handler(topic, completed))

    def _tick(self, now: float) -> None:
        """The timer's beat: re-announcements, nacks and expiries due (while connected)."""
        if not self.connected:
            return
        frames = self.senders.poll(now, self.window.waiting())
        frames += [(key, None, encode(reply)) for key, reply in self.receivers.poll(now)]
        self._publish_frames(frames)

    # ---- paho callbacks (network thread) ---------------------------------------------------

    def _on_connected(self, client: mqtt.Client, flags: Any) -> None:
        self.stats.connects += 1
        for topic in self._subscriptions:
            client.subscribe(topic, qos=1)
        now = time.monotonic()
        frames = self.senders.resume(now) + [(key, None, encode(nack)) for key, nack in self.receivers.resume(now)]
        self._publish_frames(frames)
        log.info(
            "%s: connected to %s (session present: %s, %d transfers resumed)",
            self.config.client_id,
            self.config.broker.url,
            flags.session_present,
            len(frames),
        )

    def _handle_publish(self, mid: int, reason: Any) -> None:
        transfer = self._mids.pop(mid, None)
        self.window.confirmed(mid)
        if reason.is_failure:
            self.stats.publish_denied += 1
            log.warning("%s: broker refused a publish: %s", self.config.client_id, reason)
            return
        self.stats.published += 1
        if transfer is not None:
            self.senders.touch(transfer, time.monotonic())

    def _handle_message(self, msg: mqtt.MQTTMessage) -> None:
        now = time.monotonic()
        message = self.inbound.read(msg, now)
        if isinstance(message, ChunkFrame):
            if not self.receivers.take_chunk(msg.topic, message, now):
                self.stats.rejected += 1
            elif self._after_chunk_in is not None:
                self._after_chunk_in(len(message))
        elif isinstance(message, Manifest):
            self.receivers.take_manifest(msg.topic, message, now)
        elif isinstance(message, Ack | Nack):
            self._publish_frames(self.senders.answer(message, now, msg.topic))
        elif message is not None:
            if isinstance(message, Error) and message.transfer is not None:
                self.senders.fail(message.transfer, f"{message.code}: {message.detail}")
            self._tell(msg.topic, message)

    def _tell(self, topic: str, message: Message) -> None:
        """Hand ``message`` to the owner's handler, on the dispatcher thread."""
        if self._on_message is not None:
            handler = self._on_message
            self.dispatcher.put(lambda: handler(topic, message))


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
