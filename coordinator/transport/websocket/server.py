"""The coordinator's WebSocket server: one authenticated connection per device, the device as its route.

A device dials ``wss://HOST:PORT/FLEET/DEVICE``. What the MQTT broker's ACL does, the server does itself:

- TLS with the fleet's CA and the server certificate provisioning made for the broker; a device must show a
  client certificate the CA signed and has not revoked (``crl.pem``), whose CN is the device it dials as;
- its password (``Authorization: Basic``), checked against the kits' logins in constant time;
- the connection's route is that device: every frame on it is the device's own, so it cannot speak for
  another (the roster still ignores a hello or status naming someone else, ``wrong_sender``);
- a second connection of one device replaces the first (closed with code 4000), as an MQTT takeover does;
- ``?check`` after the path asks only whether the login is accepted (``device-agent doctor``): answered 200
  after the same checks, without opening a WebSocket, so a running agent's connection is not replaced;
- a closed connection is the device's ``offline`` (MQTT's last will), unless it said so itself first;
- every frame is charged to its device's budget before it is read (the MQTT coordinator's ``InboundGuard``).

A refused handshake or login is logged with the peer's address and answered in words the device logs.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hmac
import logging
import ssl
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http import HTTPStatus

from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response
from websockets.sync.server import Server, ServerConnection, serve

from device_agent.wire.engine import Completed
from device_agent.wire.guard import InboundGuard, InboundLimits
from device_agent.wire.messages import Hello, Message, Status
from device_agent.wire.topics import DeviceTopics
from device_agent.wire.websocket.client import LOGIN_CHECK, REPLACED
from device_agent.wire.websocket.endpoint import Endpoint, WsSettings

log = logging.getLogger("fedfleet.websocket")

MessageHandler = Callable[[str, Message], None]
PayloadHandler = Callable[[str, Completed], None]
RefusalHandler = Callable[[str, str], None]
CHECK = LOGIN_CHECK


class _LoggedHandshakes(ssl.SSLSocket):
    """Logs every refused TLS handshake (websockets drops them silently): a device with a certificate of another
    fleet, revoked, or none at all is one warning naming its address and the reason."""

    def do_handshake(self, block: bool = False) -> None:
        try:
            peer = "{}:{}".format(*self.getpeername()[:2])
        except OSError:
            peer = "?"
        try:
            super().do_handshake(block)
        except ssl.SSLError as exc:
            if isinstance(exc, ssl.SSLEOFError) or exc.reason == "UNEXPECTED_EOF_WHILE_READING":
                log.debug("a TCP probe from %s closed before TLS (a device waiting for the port)", peer)
            else:
                why = getattr(exc, "verify_message", None) or exc.reason or exc
                whose = " (its client certificate)" if "CERTIFICATE" in str(exc.reason or "").upper() else ""
                log.warning("refused a TLS connection from %s: %s%s", peer, why, whose)
            raise


@dataclass(frozen=True)
class ServerTls:
    """The server's certificate and key, and the CA (and its revocation list) that client certificates need."""

    cert_file: str
    key_file: str
    ca_file: str
    crl_file: str | None = None

    def context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=self.ca_file)
        context.load_cert_chain(self.cert_file, self.key_file)
        context.verify_mode = ssl.CERT_REQUIRED
        if self.crl_file is not None:
            context.load_verify_locations(self.crl_file)
            context.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
        context.sslsocket_class = _LoggedHandshakes
        return context


def _common_name(connection: ServerConnection) -> str | None:
    sock = connection.socket
    cert = sock.getpeercert() if isinstance(sock, ssl.SSLSocket) else None
    for rdn in (cert or {}).get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None


def _basic_login(request: Request) -> tuple[str, str] | None:
    header = request.headers.get("Authorization", "")
    scheme, _, encoded = header.partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        user, sep, password = base64.b64decode(encoded, validate=True).decode().partition(":")
    except (binascii.Error, UnicodeDecodeError):
        return None
    return (user, password) if sep else None


class WsServer:
    """Serves the fleet's devices; frames go to ``endpoint`` under each device's id, messages to the handlers
    attached with :meth:`attach` (a device's last hello and status are kept for handlers that attach later)."""

    def __init__(
        self,
        fleet: str,
        host: str,
        port: int,
        passwords: Mapping[str, str],
        tls: ServerTls | None,
        settings: WsSettings | None = None,
        limits: InboundLimits | None = None,
    ) -> None:
        self.fleet, self.host, self.port = fleet, host, port
        self._passwords = dict(passwords)
        self._tls = tls
        self._handlers: tuple[MessageHandler, PayloadHandler, RefusalHandler] | None = None
        self._lock = threading.Lock()
        self._last: dict[tuple[str, str], Message] = {}
        self._connections: dict[str, ServerConnection] = {}
        self.guard = InboundGuard(limits or InboundLimits(), self._refused, f"fleet {fleet} (websocket)")
        self.endpoint = Endpoint(
            f"fedfleet-{fleet}-coordinator",
            settings or WsSettings(),
            on_message=self._message,
            on_payload=self._payload,
            guard=self.guard,
            admit=self._admit,
        )
        self._uplinks: dict[str, str] = {}
        self._server: Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"{'wss' if self._tls else 'ws'}://{self.host}:{self.port}"

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Listen (``OSError`` if the port is taken) and serve on a thread of its own."""
        settings = self.endpoint.settings
        self._server = serve(
            self._serve,
            self.host,
            self.port,
            ssl=None if self._tls is None else self._tls.context(),
            process_request=self._authenticate,
            compression=None,
            max_size=settings.limits.max_packet_bytes,
            ping_interval=settings.keepalive_s,
            ping_timeout=settings.keepalive_s,
            close_timeout=2,
            server_header="fedfleet",
        )
        self.port = self._server.socket.getsockname()[1]
        self.endpoint.start()
        self._thread = threading.Thread(target=self._server.serve_forever, name="fedfleet-ws-server", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
        with self._lock:
            connections = list(self._connections.values())
        for connection in connections:
            connection.close(1001, "coordinator stopping")
        self.endpoint.stop()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def attach(self, on_message: MessageHandler, on_payload: PayloadHandler, on_refused: RefusalHandler) -> None:
        """From now on the handlers hear every device; first each connected device's last hello and status."""
        with self._lock:
            self._handlers = on_message, on_payload, on_refused
            kept = list(self._last.items())
        for (device, _kind), message in kept:
            on_message(device, message)

    def detach(self) -> None:
        with self._lock:
            self._handlers = None

    # ---- connections -----------------------------------------------------------------------

    def _authenticate(self, connection: ServerConnection, request: Request) -> Response | None:
        """Refuse a connection before it is a WebSocket unless it is a known device of this fleet, logged in as
        itself, with its own certificate."""
        parts = request.path.split("?")[0].strip("/").split("/")
        peer = "{}:{}".format(*connection.remote_address[:2])
        if len(parts) != 2 or parts[0] != self.fleet:
            return self._refuse(
                connection,
                HTTPStatus.NOT_FOUND,
                peer,
                f"wrong path {request.path[:80]!r}: devices of fleet {self.fleet!r} dial /{self.fleet}/DEVICE",
            )
        device = parts[1]
        if device not in self._passwords:
            return self._refuse(
                connection, HTTPStatus.FORBIDDEN, peer, f"{device[:64]!r} is not a device of fleet {self.fleet!r}"
            )
        if self._tls is not None:
            name = _common_name(connection)
            if name != device:
                return self._refuse(
                    connection,
                    HTTPStatus.FORBIDDEN,
                    peer,
                    f"the client certificate of {name!r} cannot connect as {device!r}",
                )
        login = _basic_login(request)
        if (
            login is None
            or login[0] != device
            or not hmac.compare_digest(login[1].encode(), self._passwords[device].encode())
        ):
            return self._refuse(connection, HTTPStatus.UNAUTHORIZED, peer, f"wrong or missing password for {device!r}")
        if request.path.partition("?")[2] == CHECK:  # device-agent doctor: the login, not the agent's connection
            return connection.respond(HTTPStatus.OK, f"{device} may connect to fleet {self.fleet}\n")
        return None

    @staticmethod
    def _refuse(connection: ServerConnection, status: HTTPStatus, peer: str, why: str) -> Response:
        log.warning("refused a connection from %s: %s", peer, why)
        return connection.respond(status, why + "\n")

    def _serve(self, connection: ServerConnection) -> None:
        assert connection.request is not None
        device = connection.request.path.strip("/").split("/")[1]
        with self._lock:
            previous = self._connections.get(device)
            self._connections[device] = connection
            self._uplinks.setdefault(device, DeviceTopics(self.fleet, device).up)
        pipe = self.endpoint.attach(device, connection.send)  # first: the replaced one's end is then no offline
        if previous is not None:
            log.warning("%s: a new connection replaces the one from %s", device, previous.remote_address[0])
            previous.close(REPLACED, "replaced by a newer connection of this device")
        log.info("%s connected from %s", device, connection.remote_address[0])
        try:
            for data in connection:
                self.endpoint.receive(device, data)
        except ConnectionClosed:
            pass
        finally:
            with self._lock:
                if self._connections.get(device) is connection:
                    del self._connections[device]
            if self.endpoint.detach(device, pipe):
                self._went_offline(device, connection)

    def _went_offline(self, device: str, connection: ServerConnection) -> None:
        """MQTT's last will: a device whose connection closed is offline, unless it said so before it closed.

        Decided on the dispatcher thread, after the messages the device sent before its close."""
        detail = "connection lost" if connection.close_code != 1000 else "connection closed"
        self.endpoint.dispatcher.put(functools.partial(self._offline_unless_said, device, detail))

    def _offline_unless_said(self, device: str, detail: str) -> None:
        with self._lock:
            self._last.pop((device, "hello"), None)
            last = self._last.get((device, "status"))
        if not (isinstance(last, Status) and last.state == "offline"):
            self._message(device, Status(device=device, state="offline", detail=detail))

    # ---- what devices send -----------------------------------------------------------------

    def _admit(self, device: str, chunk: bool, now: float) -> bool:
        return self.guard.admit_frame(self._uplinks[device], chunk, now) is not None

    def _message(self, device: str, message: Message) -> None:
        if isinstance(message, Hello | Status):
            with self._lock:
                self._last[(device, message.type)] = message
        handlers = self._handlers
        if handlers is not None:
            handlers[0](device, message)

    def _payload(self, device: str, completed: Completed) -> None:
        handlers = self._handlers
        if handlers is None:
            log.warning("%s: a payload arrived before the round engine started; dropped", device)
            return
        handlers[1](device, completed)

    def _refused(self, device: str, reason: str) -> None:
        handlers = self._handlers
        if handlers is not None:
            handlers[2](device, reason)


__all__ = ["REPLACED", "ServerTls", "WsServer"]
