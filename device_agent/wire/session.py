"""One MQTT connection speaking the wire protocol, over paho-mqtt 2.x.

What this layer guarantees on top of paho:

- every paho callback body is guarded: an exception in a callback would otherwise silently kill
  paho's network thread while ``is_connected()`` keeps saying True;
- MQTT 5 (clean_start False + a session expiry) or 3.1.1 (clean_session False) persistent sessions,
  a fixed client id, a last will, and reconnects with exponential backoff (paho's);
- payloads go out as verified chunked transfers (``transfer``); after every reconnect unfinished
  transfers are resumed: senders re-announce, receivers nack what they lack. Nothing relies on the
  broker keeping messages for an offline client;
- every size is checked before publishing, since paho ignores the broker's maximum packet size;
- a malformed or unknown-version message is logged and dropped; the session carries on.

Callbacks given by the user run on one dispatcher thread, never on paho's network thread, so a slow
or failing handler cannot stall or kill the connection. Inbound frames are decoded and parsed on paho's
network thread; each chunk is then verified and filed on the process's hashing pool (``hashing``) while
that thread reads the next frame, and a manifest waits for its transfer's chunks still being verified,
so a seal right after the last chunk finds them filed. The pool bounds the bytes waiting for it: past
the bound paho's thread stops reading and TCP pushes back on the broker, which is what a receiver that
cannot keep up should do; a link hook (``after_chunk_in``) that sleeps slows the reading the same way.
"""

from __future__ import annotations

import collections
import logging
import queue
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from device_agent.wire import topics
from device_agent.wire.client import LeanClient
from device_agent.wire.guard import RETAINED_KINDS, InboundGuard
from device_agent.wire.hashing import shared_pool
from device_agent.wire.messages import (
    Ack,
    Error,
    Manifest,
    Message,
    Nack,
    ProtocolError,
    Status,
    VersionMismatch,
    encode,
    incompatible,
    parse_message,
)
from device_agent.wire.reachability import why_unreachable
from device_agent.wire.tls_errors import why_tls_fails
from device_agent.wire.transfer import (
    DEFAULT_CHUNK_SIZE,
    Completed,
    IncomingTransfers,
    Limits,
    OutgoingTransfer,
    PayloadTooLarge,
    TransferError,
    announce,
    chunk_is_intact,
    is_chunk_frame,
    new_transfer_id,
    parse_chunk_frame,
)

log = logging.getLogger("fedfleet.wire")

MessageHandler = Callable[[str, Message], None]
PayloadHandler = Callable[[str, Completed], None]
# Told the size of each chunk frame (bytes on the wire); may block, which is how a link is shaped.
ChunkHook = Callable[[int], object]
AWAIT_CHUNKS_S = 10.0
"""Longest a manifest waits on paho's thread for its transfer's chunks still being verified."""
IDLE_TICK_S = 30.0
"""Longest sleep of an idle session's timer thread: a transfer that starts wakes it at once (one with transfers
ticks every ``tick_s``). A worker hosts hundreds of sessions, and each wake-up costs its process the GIL."""


@dataclass(frozen=True)
class BrokerAddress:
    """Where the broker is and how to log in to it."""

    host: str = "127.0.0.1"
    port: int = 1883
    username: str | None = None
    password: str | None = None
    tls: bool = False
    ca_file: str | None = None
    # A client certificate and its key (PEM), for brokers that require one (a provisioned fleet's do).
    cert_file: str | None = None
    key_file: str | None = None

    def with_login(self, username: str, password: str) -> BrokerAddress:
        """The same broker and TLS files, another user's login."""
        return replace(self, username=username, password=password)

    @classmethod
    def from_url(
        cls, url: str, username: str | None = None, password: str | None = None, ca_file: str | None = None
    ) -> BrokerAddress:
        """``mqtt://[user:pass@]host[:1883]`` or ``mqtts://[user:pass@]host[:8883]``; arguments override the URL."""
        parts = urlsplit(url)
        if parts.scheme not in ("mqtt", "mqtts"):
            raise ValueError(f"broker URL {url!r}: scheme must be mqtt:// or mqtts://, got {parts.scheme or 'none'!r}")
        if not parts.hostname:
            raise ValueError(f"broker URL {url!r} has no host")
        if parts.path not in ("", "/") or parts.query:
            raise ValueError(f"broker URL {url!r}: unexpected path or query {parts.path}{parts.query}")
        tls = parts.scheme == "mqtts"
        try:
            port = parts.port or (8883 if tls else 1883)
        except ValueError:
            raise ValueError(f"broker URL {url!r} has an invalid port") from None
        if ca_file and not tls:
            raise ValueError(f"a CA file was given for {url!r}, which is not mqtts://")
        return cls(
            host=parts.hostname,
            port=port,
            username=username if username is not None else (unquote(parts.username) if parts.username else None),
            password=password if password is not None else (unquote(parts.password) if parts.password else None),
            tls=tls,
            ca_file=ca_file,
        )

    @property
    def url(self) -> str:
        """The address without credentials, for logs."""
        return f"{'mqtts' if self.tls else 'mqtt'}://{self.host}:{self.port}"


@dataclass(frozen=True)
class SessionConfig:
    """Connection and transfer settings; the defaults suit a LAN fleet on mosquitto."""

    client_id: str
    broker: BrokerAddress = field(default_factory=BrokerAddress)
    protocol: Literal["5", "3.1.1"] = "5"
    session_expiry_s: int = 3600
    keepalive_s: int = 30
    reconnect_min_s: int = 1
    reconnect_max_s: int = 30
    max_inflight: int = 100
    chunk_size: int = DEFAULT_CHUNK_SIZE
    limits: Limits = field(default_factory=Limits)
    resend_after_s: float = 5.0
    nack_after_s: float = 2.0
    max_attempts: int = 20
    tick_s: float = 0.2
    send_window_bytes: int = 32 * 2**20
    """Most bytes of chunk frames handed to paho and not yet confirmed by the broker (PUBACK); later frames
    wait their turn. Without it a coordinator pushing a model to 1,000 devices built every device's frames at
    once: ~500 MB queued in paho (and in the broker) before the first device had its model."""


@dataclass
class SessionStats:
    rejected: int = 0
    connects: int = 0
    publish_denied: int = 0
    published: int = 0
    # Bytes of every MQTT payload by topic, retransmissions included: the true protocol cost.
    bytes_in: dict[str, int] = field(default_factory=dict)
    bytes_out: dict[str, int] = field(default_factory=dict)


class LoginRefused(ConnectionError):
    """The broker refused this client's credentials; retrying with the same ones cannot succeed."""


_REFUSED_LOGINS = ("Not authorized", "Bad user name or password")


class Delivery:
    """A payload on its way; ``wait`` returns once the receiver acked the verified bytes."""

    def __init__(self, transfer: str) -> None:
        self.transfer = transfer
        self._event = threading.Event()
        self.error: str | None = None
        self.settled_at: float | None = None
        """When the receiver acked it or it failed (``time.monotonic()``)."""
        self.refused = False
        """The receiver answered with an error (it will not take these bytes): sending them again is pointless."""

    @property
    def done(self) -> bool:
        return self._event.is_set() and self.error is None

    def _settle(self, error: str | None = None) -> None:
        self.error = error
        self.settled_at = time.monotonic()
        self._event.set()

    def wait(self, timeout: float | None = None) -> None:
        if not self._event.wait(timeout):
            raise TimeoutError(f"transfer {self.transfer} not acknowledged within {timeout} s")
        if self.error is not None:
            raise TransferError(f"transfer {self.transfer} failed: {self.error}")


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
        self.config = config
        self._guard_in = guard
        self.stats = SessionStats()
        self._subscriptions = list(subscriptions)
        self._on_message = on_message
        self._on_payload = on_payload
        self._before_chunk_out = before_chunk_out
        self._after_chunk_in = after_chunk_in
        self._lock = threading.RLock()
        self._outgoing: dict[str, tuple[str, OutgoingTransfer, Delivery]] = {}
        self._incoming: dict[str, IncomingTransfers] = {}
        self._open: dict[str, IncomingTransfers] = {}
        """The receivers with an unfinished transfer (kept by :meth:`_track`): a coordinator's timer and guard ask
        these, not all of its 1,000 peers, several times a second."""
        self._mids: dict[int, str] = {}
        self._connected = threading.Event()
        self._refused = threading.Event()
        self._refusal = ""
        self._stale: tuple[Callable[[Manifest], bool], str] | None = None
        self._unreachable_said = False
        self.connect_failure: str | None = None
        """Why the last attempt to connect failed (unreachable, TLS handshake...), said once per outage."""
        self._stopping = threading.Event()
        self._events: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._threads: list[threading.Thread] = []
        # The send window (SessionConfig.send_window_bytes): transfers' first frames wait in the backlog, in order.
        self._window_lock = threading.Lock()
        self._backlog: collections.deque[tuple[str, str, Iterator[bytes]]] = collections.deque()
        self._in_window = 0
        self._frame_sizes: dict[int, int] = {}
        """Per mid handed to paho, its bytes in the window (0: outside it); popped at its PUBACK."""
        self._acked_early: set[int] = set()
        """PUBACKs whose publish had not returned its mid yet (a fast broker answers before paho returns)."""
        self._pump_due = threading.Event()
        self._idle = False
        """The timer thread sleeps until woken (set and read under ``self._lock``, see :meth:`_busy`)."""
        self._pumping = threading.Lock()
        self._hashing = shared_pool()
        self._verifying: collections.Counter[str] = collections.Counter()
        """Per transfer, its chunks handed to the hashing pool and not yet filed."""
        self._filed = threading.Condition()
        self._client = self._make_client(will)

    # ---- lifecycle -------------------------------------------------------------------------

    def _make_client(self, will: tuple[str, Message] | None) -> mqtt.Client:
        cfg = self.config
        v5 = cfg.protocol == "5"
        client = LeanClient(
            CallbackAPIVersion.VERSION2,
            client_id=cfg.client_id,
            clean_session=None if v5 else False,
            protocol=MQTTProtocolVersion.MQTTv5 if v5 else MQTTProtocolVersion.MQTTv311,
        )
        if cfg.broker.username is not None:
            client.username_pw_set(cfg.broker.username, cfg.broker.password)
        if cfg.broker.tls:
            client.tls_set(
                ca_certs=cfg.broker.ca_file,
                certfile=cfg.broker.cert_file,
                keyfile=cfg.broker.key_file,
                cert_reqs=ssl.CERT_REQUIRED,
            )
        if will is not None:
            client.will_set(will[0], encode(will[1]), qos=1, retain=True)
        # A keepalive ping goes out at most a quarter of the keepalive late; the broker waits one and a half.
        client.idle_s = min(10.0, cfg.keepalive_s / 4)
        client.reconnect_delay_set(cfg.reconnect_min_s, cfg.reconnect_max_s)
        client.max_inflight_messages_set(cfg.max_inflight)
        client.on_connect = self._guard(self._handle_connect)
        client.on_disconnect = self._guard(self._handle_disconnect)
        client.on_connect_fail = self._guard(self._handle_connect_fail)
        client.on_message = self._guard(self._handle_message)
        client.on_publish = self._guard(self._handle_publish)
        client.on_socket_open = self._guard(_no_delay)
        return client

    def start(self, timeout: float | None = 10.0) -> Session:
        """Connect (retrying with backoff in the background) and wait up to ``timeout`` s for the first connection.

        ``timeout=None`` returns at once; the session keeps trying to connect either way, except after
        :attr:`refused` credentials: then ``start`` raises :class:`LoginRefused` (with a timeout) and
        the session stops trying.
        """
        cfg = self.config
        properties = None
        if cfg.protocol == "5":
            properties = Properties(PacketTypes.CONNECT)
            properties.SessionExpiryInterval = cfg.session_expiry_s
        self._client.connect_async(
            cfg.broker.host,
            cfg.broker.port,
            keepalive=cfg.keepalive_s,
            clean_start=False if cfg.protocol == "5" else mqtt.MQTT_CLEAN_START_FIRST_ONLY,
            properties=properties,
        )
        self._client.loop_start()
        for target, name in (
            (self._dispatch_loop, "dispatch"),
            (self._tick_loop, "tick"),
        ):
            thread = threading.Thread(target=target, name=f"fedfleet-{name}-{cfg.client_id}", daemon=True)
            thread.start()
            self._threads.append(thread)
        if timeout is None:
            return self
        deadline = time.monotonic() + timeout
        while not self._connected.wait(min(0.05, max(0.0, deadline - time.monotonic()))):
            if self._refused.is_set():
                self.stop()
                raise LoginRefused(self._refusal)
            if time.monotonic() >= deadline:
                self.stop()
                raise ConnectionError(f"{cfg.client_id}: could not connect to {cfg.broker.url} within {timeout} s")
        return self

    def stop(self, settle_s: float = 1.0) -> None:
        """Disconnect cleanly (the broker then discards the will) and stop every thread.

        Waits up to ``settle_s`` for the broker to acknowledge what was published: a DISCONNECT sent while a
        PUBLISH was unacknowledged closed the socket under the broker's PUBACK, and mosquitto, failing that
        write before it read the DISCONNECT, published the will after a clean stop (8 of 30 stops right after
        a retained status, 0 of 60 since).
        """
        self._stopping.set()
        self._pump_due.set()
        deadline = time.monotonic() + settle_s
        while self._connected.is_set() and self._unacknowledged() and time.monotonic() < deadline:
            time.sleep(0.01)
        self._client.disconnect()
        self._client.loop_stop()
        self._events.put(None)
        for thread in self._threads:
            thread.join(timeout=5)
        self._threads.clear()

    def _unacknowledged(self) -> bool:
        """Whether a publish handed to paho still waits for the broker's PUBACK."""
        with self._window_lock:
            return bool(self._frame_sizes)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    @property
    def refused(self) -> str | None:
        """Why the broker refused this client's login, once it has; the session then stops reconnecting."""
        return self._refusal if self._refused.is_set() else None

    def receiving(self) -> list[str]:
        """Ids of inbound transfers started but not yet complete."""
        with self._lock:
            return [tid for transfers in self._open.values() for tid in transfers.pending()]

    def wait_connected(self, timeout: float) -> bool:
        return self._connected.wait(timeout)

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
        cfg = self.config
        if manifest is None:
            manifest = announce(len(payload), cfg.chunk_size, limits=cfg.limits, **manifest_fields)
        else:
            cfg.limits.check(manifest.size, manifest.chunk_size)
            manifest = manifest.model_copy(update={"transfer": manifest_fields.get("transfer") or new_transfer_id()})
        # The seal is the largest control message of a transfer: check it before the first byte leaves.
        placeholder = ["0" * 64] * manifest.chunk_count
        self._check_packet(
            len(encode(manifest.model_copy(update={"chunks": placeholder, "digest": "0" * 64}))), "manifest"
        )
        outgoing = OutgoingTransfer(
            manifest, payload, time.monotonic(), resend_after=cfg.resend_after_s, max_attempts=cfg.max_attempts
        )
        delivery = Delivery(manifest.transfer)
        with self._lock:
            self._outgoing[manifest.transfer] = (topic, outgoing, delivery)
        with self._window_lock:
            self._backlog.append((topic, manifest.transfer, outgoing.start(self._hashing)))
        self._wake()
        self._pump()
        return delivery

    def _pump(self, retry: bool = True) -> None:
        """Publish backlog frames while the window has room (never from paho's thread: a link hook may block).

        One thread pumps at a time, so a transfer's frames leave in order (a seal overtaking the last chunk
        would draw a nack and a repair); a caller that finds another pumping leaves the rest to the timer thread
        (``retry``). The timer thread itself tries again at its next tick: while a shaped link holds the other
        pumper for seconds, asking itself again at once would spin.
        """
        if not self._pumping.acquire(blocking=False):
            if retry:
                self._pump_due.set()
            return
        try:
            window = self.config.send_window_bytes
            while True:
                with self._window_lock:
                    if not self._backlog or self._in_window >= window:
                        return
                    topic, transfer, frames = self._backlog[0]
                    frame = next(frames, None) if transfer in self._outgoing else None
                    if frame is None:  # finished, or cancelled, refused or failed on the way
                        self._backlog.popleft()
                        continue
                    self._in_window += len(frame)
                self._publish(topic, frame, transfer=transfer, windowed=True)
        finally:
            self._pumping.release()

    @property
    def in_window(self) -> int:
        """Bytes of chunk frames handed to paho and not yet confirmed by the broker."""
        return self._in_window

    def _check_packet(self, size: int, what: str) -> None:
        if size + 512 > self.config.limits.max_packet_bytes:
            raise PayloadTooLarge(
                f"{what} of {size} bytes would exceed the broker's {self.config.limits.max_packet_bytes}-byte "
                "maximum packet size; nothing was sent"
            )

    def _publish(
        self, topic: str, data: bytes, retain: bool = False, transfer: str | None = None, windowed: bool = False
    ) -> None:
        # Never called with self._lock or self._window_lock held: paho holds its own message lock while it
        # runs on_publish, which takes them; publishing under either would deadlock.
        try:
            self._check_packet(len(data), "message")
            if self._before_chunk_out is not None and transfer is not None and is_chunk_frame(data):
                self._before_chunk_out(len(data))
            self.stats.bytes_out[topic] = self.stats.bytes_out.get(topic, 0) + len(data)
            info = self._client.publish(topic, data, qos=1, retain=retain)
        except BaseException:
            if windowed:
                self._settle_window(len(data))
            raise
        if transfer is not None and info.mid:
            self._mids[info.mid] = transfer
        size = len(data) if windowed else 0
        with self._window_lock:
            if info.mid in self._acked_early:
                self._acked_early.discard(info.mid)
            else:
                self._frame_sizes[info.mid] = size
                size = 0
        if size:
            self._settle_window(size)

    def _settle_window(self, size: int) -> None:
        """``size`` bytes left the window: the backlog may go on (on the timer thread, see :meth:`_pump`)."""
        with self._window_lock:
            self._in_window -= size
            more = bool(self._backlog)
        if more:
            self._pump_due.set()

    def _publish_all(self, frames: Iterable[tuple[str, bytes]], transfer: str | None = None) -> None:
        for topic, data in frames:
            if transfer is not None and transfer not in self._outgoing:
                return  # cancelled, refused or failed on the way: the rest would only be dropped
            self._publish(topic, data, transfer=transfer)

    # ---- paho callbacks (network thread) ---------------------------------------------------

    def _guard(self, fn: Callable[..., None]) -> Callable[..., None]:
        def guarded(*args: Any) -> None:
            try:
                fn(*args)
            except Exception:
                log.exception("%s: error in %s (the connection stays up)", self.config.client_id, fn.__name__)

        return guarded

    def _handle_connect(self, client: mqtt.Client, _userdata: Any, flags: Any, reason: Any, _props: Any) -> None:
        if reason.is_failure:
            log.warning(
                "%s: broker %s refused the connection: %s", self.config.client_id, self.config.broker.url, reason
            )
            if str(reason) in _REFUSED_LOGINS:
                # Retrying with the same wrong credentials only hammers the broker.
                user = self.config.broker.username
                self._refusal = (
                    f"broker {self.config.broker.url} refused the login of user {user!r} "
                    f"(client {self.config.client_id}): {reason}"
                )
                self._refused.set()
                client.disconnect()
            return
        self.stats.connects += 1
        self._unreachable_said = False
        for topic in self._subscriptions:
            client.subscribe(topic, qos=1)
        now = time.monotonic()
        with self._lock:
            frames = [
                (outgoing.transfer, topic, frame)
                for topic, outgoing, _delivery in self._outgoing.values()
                for frame in outgoing.resume(now)
            ]
            frames += [
                (None, answered_on, encode(transfers.resume(tid, now)))
                for answered_on, transfers in self._open.items()
                for tid in transfers.pending()
            ]
        for transfer, topic, frame in frames:
            self._publish(topic, frame, transfer=transfer)
        log.info(
            "%s: connected to %s (session present: %s, %d transfers resumed)",
            self.config.client_id,
            self.config.broker.url,
            flags.session_present,
            len(frames),
        )
        self._connected.set()

    def _handle_connect_fail(self, _client: mqtt.Client, _userdata: Any) -> None:
        # paho retries in silence; say why once per outage (a wrong host or port looks like a hang).
        if not self._unreachable_said:
            self._unreachable_said = True
            broker = self.config.broker
            why = why_unreachable(broker.host, broker.port)
            if why is None and broker.tls:  # TCP opens, so the handshake failed: the clock, the CA, the name?
                problem = why_tls_fails(broker.host, broker.port, broker.ca_file, broker.cert_file, broker.key_file)
                why = str(problem) if problem else None
            why = self.connect_failure = why or "the connection failed"
            log.warning("%s: cannot reach broker %s: %s; retrying", self.config.client_id, broker.url, why)

    def _handle_disconnect(self, _client: mqtt.Client, _userdata: Any, _flags: Any, reason: Any, _props: Any) -> None:
        self._connected.clear()
        if not self._stopping.is_set():
            log.warning(
                "%s: disconnected from %s (%s); reconnecting", self.config.client_id, self.config.broker.url, reason
            )

    def _handle_publish(self, _client: mqtt.Client, _userdata: Any, mid: int, reason: Any, _props: Any) -> None:
        transfer = self._mids.pop(mid, None)
        with self._window_lock:
            size = self._frame_sizes.pop(mid, None)
            if size is None:
                self._acked_early.add(mid)
        if size:
            self._settle_window(size)
        if reason.is_failure:
            self.stats.publish_denied += 1
            log.warning("%s: broker refused a publish: %s", self.config.client_id, reason)
            return
        self.stats.published += 1
        entry = self._outgoing.get(transfer) if transfer is not None else None
        if entry is not None:
            # Without self._lock on purpose (see _publish): a lone float update, atomic under the GIL.
            entry[1].touch(time.monotonic())

    def _handle_message(self, _client: mqtt.Client, _userdata: Any, msg: mqtt.MQTTMessage) -> None:
        data = msg.payload
        now = time.monotonic()
        guard, peer = self._guard_in, topics.device_of(msg.topic) or msg.topic
        if guard is not None:
            # Every frame costs its device a token and must be on a documented topic, before any state is kept.
            admitted = guard.admit_frame(msg.topic, is_chunk_frame(data), now)
            if admitted is None:
                return
            peer = admitted
        self.stats.bytes_in[msg.topic] = self.stats.bytes_in.get(msg.topic, 0) + len(data)
        if guard is not None and not data:
            return  # a retained message being cleared (see below)
        try:
            if is_chunk_frame(data):
                if guard is None or guard.admit_message(peer, None, msg.retain, now):
                    self._take_chunk(msg.topic, data, now)
                elif msg.retain:
                    self._publish(msg.topic, b"", retain=True)
                return
            message = parse_message(data)
        except ProtocolError as exc:
            self.stats.rejected += 1
            wrong_version = isinstance(exc, VersionMismatch)
            first = True
            if guard is not None:  # a peer of another version is answered once per burst, not per message
                reason = "wrong_version" if wrong_version else "malformed"
                first = guard.refuse_first(peer, reason, f"on {msg.topic}: {exc}", now)
            else:
                log.warning("%s: rejected a message on %s: %s", self.config.client_id, msg.topic, exc)
            if isinstance(exc, VersionMismatch) and first:
                self._answer_incompatible(msg.topic, exc.version)
            return
        if guard is not None and not guard.admit_message(peer, message, msg.retain, now):
            if msg.retain and not isinstance(message, RETAINED_KINDS):
                self._publish(msg.topic, b"", retain=True)  # clear it: no later subscriber gets it either
            return
        if isinstance(message, Manifest):
            self._await_chunks(message.transfer)
            self._receive(msg.topic, lambda r: self._admit_manifest(msg.topic, r, message, now))
        elif isinstance(message, Ack | Nack):
            self._on_transfer_answer(message, now, msg.topic)
        else:
            if isinstance(message, Error) and message.transfer is not None:
                self._fail(message.transfer, f"{message.code}: {message.detail}")
            if self._on_message is not None:
                handler = self._on_message
                self._events.put(lambda: handler(msg.topic, message))

    def _answer_incompatible(self, topic: str, version: object) -> None:
        """Tell a peer of another protocol version to stop, and this session's owner who it was."""
        answer = incompatible(version)
        try:
            self._publish(topics.reply_topic(topic), encode(answer))
        except ValueError:
            return  # not a device topic: nobody to answer
        if self._on_message is not None:
            handler = self._on_message
            self._events.put(lambda: handler(topic, answer))

    # ---- transfer plumbing -----------------------------------------------------------------

    def _receiver(self, key: str) -> IncomingTransfers:
        """The incoming transfers of one peer, keyed by where it is answered (:func:`_answered_on` of its topic)."""
        transfers = self._incoming.get(key)
        if transfers is None:
            if self._guard_in is not None:
                transfers = self._guard_in.limits.receiver(self.config.nack_after_s)
            else:
                transfers = IncomingTransfers(nack_after=self.config.nack_after_s)
            self._incoming[key] = transfers
        return transfers

    def _track(self, key: str, transfers: IncomingTransfers) -> None:
        """Keep :attr:`_open` current after ``transfers`` changed (called under ``self._lock``)."""
        if transfers.pending():
            self._open[key] = transfers
        else:
            self._open.pop(key, None)

    def _reply(self, topic: str, replies: list[Message]) -> None:
        for reply in replies:
            self._publish(topics.reply_topic(topic), encode(reply))

    def _deliver_payload(self, topic: str, completed: Completed) -> None:
        if self._on_payload is not None:
            handler = self._on_payload
            self._events.put(lambda: handler(topic, completed))

    def _on_transfer_answer(self, message: Ack | Nack, now: float, source: str) -> None:
        with self._lock:
            entry = self._outgoing.get(message.transfer)
            if entry is None:
                return  # an answer to a transfer already settled: a duplicate ack
            topic, outgoing, delivery = entry
            if topics.device_of(topic) != topics.device_of(source):
                if self._guard_in is not None:  # only the transfer's receiver may ack or nack it
                    detail = f"a {message.type} for a transfer to {topics.device_of(topic)}"
                    self._guard_in.refuse(topics.device_of(source) or source, "wrong_sender", detail, now)
                return
            if isinstance(message, Nack):
                frames = outgoing.on_nack(message, now)
            else:
                frames = []
                outgoing.on_ack(message)
                del self._outgoing[message.transfer]
        if isinstance(message, Ack):
            delivery._settle(outgoing.failed)
        self._publish_all([(topic, frame) for frame in frames], transfer=outgoing.transfer)

    def _fail(self, transfer: str, error: str) -> None:
        """The receiver refused ``transfer``."""
        with self._lock:
            entry = self._outgoing.pop(transfer, None)
        if entry is not None:
            entry[2].refused = True
            entry[2]._settle(error)

    def cancel(self, stale: Callable[[Manifest], bool], why: str) -> int:
        """Stop sending every outgoing transfer whose manifest is ``stale`` (no more chunks, re-announcements
        or repairs); their deliveries fail with ``why``. How many were cancelled."""
        with self._lock:
            cancelled = [tid for tid, (_t, outgoing, _d) in self._outgoing.items() if stale(outgoing.manifest)]
            entries = [self._outgoing.pop(tid) for tid in cancelled]
        for _topic, _outgoing, delivery in entries:
            delivery._settle(f"cancelled: {why}")
        return len(entries)

    def refuse(self, stale: Callable[[Manifest], bool], why: str) -> int:
        """From now on answer every new inbound transfer whose manifest is ``stale`` with an error saying ``why``,
        before any of its chunks is kept, and drop the unfinished ones already open (replaces the last rule).
        How many unfinished transfers were dropped."""
        with self._lock:
            self._stale = stale, why
            dropped = 0
            for key, transfers in list(self._open.items()):
                dropped += len(transfers.drop_where(stale))
                self._track(key, transfers)
            return dropped

    def _tick_loop(self) -> None:
        # An idle session (nothing on its way either way) sleeps up to IDLE_TICK_S: a worker hosts hundreds of
        # sessions, and each wake-up costs its process the GIL. A transfer that starts wakes it (_wake), and so
        # do frames the window let go.
        due = time.monotonic() + self.config.tick_s
        while not self._stopping.is_set():
            self._pump_due.wait(max(0.0, due - time.monotonic()))
            if self._stopping.is_set():
                return
            try:
                if self._pump_due.is_set():
                    self._pump_due.clear()
                    self._pump(retry=False)
                now = time.monotonic()
                if not self._idle:  # woken from an idle sleep: tick at the busy pace from now on
                    due = min(due, now + self.config.tick_s)
                if now >= due:
                    self._pump(retry=False)
                    if self._connected.is_set():
                        self._tick(now)
                    due = now + (self.config.tick_s if self._busy() else IDLE_TICK_S)
            except Exception:
                log.exception("%s: error in the transfer timer (it keeps running)", self.config.client_id)

    def _busy(self) -> bool:
        """Whether a transfer is on its way either way; the timer thread is idle until one starts if not."""
        with self._lock:  # paho's thread adds a receiver for each new peer
            busy = bool(self._outgoing) or bool(self._open)
            self._idle = not busy
        return busy

    def _wake(self) -> None:
        """A transfer started (after it was added, under ``self._lock``): an idle timer thread ticks again."""
        with self._lock:
            idle, self._idle = self._idle, False
        if idle:
            self._pump_due.set()

    def _tick(self, now: float) -> None:
        frames: list[tuple[str, str | None, bytes]] = []
        failed: list[tuple[OutgoingTransfer, Delivery]] = []
        with self._window_lock:  # a transfer still waiting for the window is waiting for us, not for its receiver
            waiting = {transfer for _topic, transfer, _frames in self._backlog}
        with self._lock:
            for tid, (topic, outgoing, delivery) in list(self._outgoing.items()):
                if tid in waiting:
                    outgoing.touch(now)
                frames += [(topic, tid, frame) for frame in outgoing.poll(now)]
                if outgoing.failed:
                    del self._outgoing[tid]
                    failed.append((outgoing, delivery))
            for answered_on, transfers in list(self._open.items()):
                frames += [(answered_on, None, encode(reply)) for reply in transfers.poll(now)]
                self._track(answered_on, transfers)
        for outgoing, delivery in failed:
            log.warning("%s: transfer %s failed: %s", self.config.client_id, outgoing.transfer, outgoing.failed)
            delivery._settle(outgoing.failed)
        for topic, tid, frame in frames:
            self._publish(topic, frame, transfer=tid)

    def _take_chunk(self, topic: str, frame: bytes | memoryview, now: float) -> None:
        """Parse one chunk frame on paho's thread and hand it to the hashing pool to verify and file."""
        try:
            transfer, index, chunk, digest = parse_chunk_frame(frame)
        except ProtocolError as exc:
            self.stats.rejected += 1
            if self._guard_in is not None:
                self._guard_in.refuse(topics.device_of(topic) or topic, "malformed", f"on {topic}: {exc}", now)
            else:
                log.warning("%s: rejected a message on %s: %s", self.config.client_id, topic, exc)
            return
        with self._filed:
            self._verifying[transfer] += 1
        self._hashing.verify(len(chunk), lambda: self._file_chunk(topic, transfer, index, chunk, digest, now))
        if self._after_chunk_in is not None:
            self._after_chunk_in(len(frame))

    def _file_chunk(self, topic: str, transfer: str, index: int, chunk: memoryview, digest: bytes, now: float) -> None:
        """Verify one chunk and file it (on a hashing thread; hashed outside ``self._lock``)."""
        try:
            if self._stopping.is_set():
                return
            intact = chunk_is_intact(chunk, digest)
            self._receive(topic, lambda r: r.on_chunk(transfer, index, chunk, digest, now, intact))
            if not intact and self._guard_in is not None:
                detail = f"chunk {index} of transfer {transfer} does not match its digest; asked for again"
                self._guard_in.refuse(topics.device_of(topic) or topic, "corrupt_chunk", detail, now)
        finally:
            with self._filed:
                self._verifying[transfer] -= 1
                if not self._verifying[transfer]:
                    del self._verifying[transfer]
                    self._filed.notify_all()

    def _await_chunks(self, transfer: str) -> None:
        """Wait (on paho's thread) until ``transfer``'s chunks read before its manifest are filed: a seal that
        found its last chunks still being verified would nack them, and its sender would send them again.

        At most :data:`AWAIT_CHUNKS_S`: past it the manifest goes on (its nack costs resends, not a transfer),
        so a hashing pool that stopped keeping up never stops this connection's reading for good.
        """
        with self._filed:
            if not self._filed.wait_for(lambda: not self._verifying[transfer], AWAIT_CHUNKS_S):
                log.warning(
                    "%s: %d chunk(s) of transfer %s still waited for verification after %.0f s; its manifest goes on",
                    self.config.client_id,
                    self._verifying[transfer],
                    transfer,
                    AWAIT_CHUNKS_S,
                )

    def _admit_manifest(
        self, topic: str, receiver: IncomingTransfers, manifest: Manifest, now: float
    ) -> tuple[list[Message], Completed | None]:
        """A new transfer past the guard's bounds is refused before the receiver allocates anything for it."""
        refusal = self._stale_refusal(manifest) or self._transfer_refusal(topic, receiver, manifest)
        return ([refusal], None) if refusal is not None else receiver.on_manifest(manifest, now)

    def _stale_refusal(self, manifest: Manifest) -> Error | None:
        if self._stale is None or not self._stale[0](manifest):
            return None
        return Error(code="rejected", transfer=manifest.transfer, detail=self._stale[1])

    def _receive(self, topic: str, step: Callable[[IncomingTransfers], tuple[list[Message], Completed | None]]) -> None:
        """One step of ``topic``'s incoming transfers under the lock; replies and hand-over outside it."""
        try:
            key = _answered_on(topic)
            with self._lock:
                receiver = self._receiver(key)
                replies, completed = step(receiver)
                self._track(key, receiver)
                opened = self._idle and bool(self._open)
            if opened:
                self._wake()
            self._reply(topic, replies)
            if completed is not None:
                self._deliver_payload(topic, completed)
        except Exception:
            log.exception("%s: error receiving on %s (the session keeps running)", self.config.client_id, topic)

    def _transfer_refusal(self, topic: str, mine: IncomingTransfers, manifest: Manifest) -> Error | None:
        """The error answering a new transfer the guard refuses (called under ``self._lock``).

        Bounds hold per peer (one receiver each): a new transfer past them evicts the peer's least recently
        active one, so a sender whose old transfers were cut off is not locked out.
        """
        guard = self._guard_in
        if guard is None:
            return None
        peer = topics.device_of(topic) or topic
        if mine.knows(manifest.transfer):
            return None
        now = time.monotonic()
        problem = guard.manifest_problem(manifest)
        held = sum(t.pending_bytes() for t in self._open.values())
        if problem is None and held + manifest.size > guard.limits.max_total_pending_bytes:
            problem = (
                f"the receiver holds {held} bytes of unfinished transfers from all peers (at most "
                f"{guard.limits.max_total_pending_bytes}); send it again later"
            )
        if problem is not None:
            guard.refuse(peer, "transfer_refused", f"transfer {manifest.transfer}: {problem}", now)
            return Error(code="too_large", transfer=manifest.transfer, detail=problem)
        while guard.over(manifest, len(mine.pending()), mine.pending_bytes()) and (oldest := mine.oldest()):
            _seen, tid = oldest
            mine.drop(tid)
            guard.refuse(peer, "transfer_evicted", f"unfinished transfer {tid} dropped for a newer one", now)
        return None

    def _dispatch_loop(self) -> None:
        while (event := self._events.get()) is not None:
            try:
                event()
            except Exception:
                log.exception("%s: error in a message handler (the session keeps running)", self.config.client_id)
            event = None  # a delivered payload is its receiver's now, not kept until the next message


def _answered_on(topic: str) -> str:
    """Where a peer's transfers on ``topic`` are answered (its opposite ``data`` topic): one key per peer."""
    try:
        return topics.reply_topic(topic)
    except ValueError:
        return topic  # not a device topic: only a session outside the fleet layout sees one


def _no_delay(_client: mqtt.Client, _userdata: Any, sock: Any) -> None:
    """Send small packets at once (paho leaves Nagle on): an ack or nack written right after a PUBACK
    otherwise waits for the broker's delayed TCP ack, ~40 ms on Linux, once per transfer or repair."""
    if isinstance(sock, socket.socket):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


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
