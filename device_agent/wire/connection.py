"""One persistent MQTT connection over paho-mqtt 2.x: client id, persistent session, last will, backoff.

What it adds to paho: every callback body is guarded (an exception in a callback would otherwise silently
kill paho's network thread while ``is_connected()`` keeps saying True); MQTT 5 (clean_start False + a session
expiry) or 3.1.1 (clean_session False) persistent sessions; reconnects with paho's exponential backoff,
except after refused credentials; why a connect fails, said once per outage.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from device_agent.wire.client import LeanClient
from device_agent.wire.messages import Message, encode
from device_agent.wire.reachability import why_unreachable
from device_agent.wire.settings import SessionConfig
from device_agent.wire.tls_errors import why_tls_fails

log = logging.getLogger("fedfleet.wire")

_REFUSED_LOGINS = ("Not authorized", "Bad user name or password")


class LoginRefused(ConnectionError):
    """The broker refused this client's credentials; retrying with the same ones cannot succeed."""


class Connection:
    """The paho client of one session and the state of its connection.

    ``on_connected(flags)`` runs on paho's thread after every successful connect, before :attr:`connected` is
    set (the session resubscribes and resumes its transfers there); ``on_message(msg)`` and ``on_publish(mid,
    reason)`` are paho's, guarded.
    """

    def __init__(
        self,
        config: SessionConfig,
        will: tuple[str, Message] | None,
        on_connected: Callable[[mqtt.Client, Any], None],
        on_message: Callable[[mqtt.MQTTMessage], None],
        on_publish: Callable[[int, Any], None],
    ) -> None:
        self.config = config
        self._on_connected = on_connected
        self._connected = threading.Event()
        self._refused = threading.Event()
        self._refusal = ""
        self._unreachable_said = False
        self.stopping = threading.Event()
        self.connect_failure: str | None = None
        """Why the last attempt to connect failed (unreachable, TLS handshake...), said once per outage."""
        self.client = self._make_client(will)
        self.client.on_message = self._guard(lambda _c, _u, msg: on_message(msg), "on_message")
        self.client.on_publish = self._guard(lambda _c, _u, mid, reason, _p: on_publish(mid, reason), "on_publish")

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
        client.on_socket_open = self._guard(_no_delay)
        return client

    def _guard(self, fn: Callable[..., None], name: str | None = None) -> Callable[..., None]:
        def guarded(*args: Any) -> None:
            try:
                fn(*args)
            except Exception:
                log.exception("%s: error in %s (the connection stays up)", self.config.client_id, name or fn.__name__)

        return guarded

    @property
    def connected(self) -> threading.Event:
        return self._connected

    @property
    def refused(self) -> str | None:
        """Why the broker refused this client's login, once it has; the client then stops reconnecting."""
        return self._refusal if self._refused.is_set() else None

    def start(self) -> None:
        """Connect in the background (paho retries with backoff)."""
        cfg = self.config
        properties = None
        if cfg.protocol == "5":
            properties = Properties(PacketTypes.CONNECT)
            properties.SessionExpiryInterval = cfg.session_expiry_s
        self.client.connect_async(
            cfg.broker.host,
            cfg.broker.port,
            keepalive=cfg.keepalive_s,
            clean_start=False if cfg.protocol == "5" else mqtt.MQTT_CLEAN_START_FIRST_ONLY,
            properties=properties,
        )
        self.client.loop_start()

    def wait_first(self, timeout: float) -> None:
        """Wait for the first connection; :class:`LoginRefused` or ``ConnectionError`` if none comes."""
        deadline = time.monotonic() + timeout
        while not self._connected.wait(min(0.05, max(0.0, deadline - time.monotonic()))):
            if self._refused.is_set():
                raise LoginRefused(self._refusal)
            if time.monotonic() >= deadline:
                cfg = self.config
                raise ConnectionError(f"{cfg.client_id}: could not connect to {cfg.broker.url} within {timeout} s")

    def stop(self) -> None:
        self.stopping.set()
        self.client.disconnect()
        self.client.loop_stop()

    def _handle_connect(self, client: mqtt.Client, _userdata: Any, flags: Any, reason: Any, _props: Any) -> None:
        cfg = self.config
        if reason.is_failure:
            log.warning("%s: broker %s refused the connection: %s", cfg.client_id, cfg.broker.url, reason)
            if str(reason) in _REFUSED_LOGINS:
                # Retrying with the same wrong credentials only hammers the broker.
                user = cfg.broker.username
                self._refusal = (
                    f"broker {cfg.broker.url} refused the login of user {user!r} (client {cfg.client_id}): {reason}"
                )
                self._refused.set()
                client.disconnect()
            return
        self._unreachable_said = False
        self._on_connected(client, flags)
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
        if not self.stopping.is_set():
            log.warning(
                "%s: disconnected from %s (%s); reconnecting", self.config.client_id, self.config.broker.url, reason
            )


def _no_delay(_client: mqtt.Client, _userdata: Any, sock: Any) -> None:
    """Send small packets at once (paho leaves Nagle on): an ack or nack written right after a PUBACK
    otherwise waits for the broker's delayed TCP ack, ~40 ms on Linux, once per transfer or repair."""
    if isinstance(sock, socket.socket):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
