"""A device's WebSocket to its coordinator: TLS, its login, reconnects with backoff, resumes after each.

The device dials ``wss://HOST:PORT/FLEET/DEVICE``, verifies the server against its kit's CA, shows its client
certificate, and logs in with its password in an ``Authorization: Basic`` header. A refused login (HTTP 401 or
403) is final, as a broker's refusal is; anything else (unreachable, a TLS handshake that fails, a dropped
connection) is retried with exponential backoff and jitter, and said once per outage with its cause.
"""

from __future__ import annotations

import base64
import logging
import random
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI
from websockets.sync.client import ClientConnection, connect

from device_agent.wire.tls_errors import why_tls_fails
from device_agent.wire.websocket.endpoint import Endpoint

log = logging.getLogger("fedfleet.wire")

COORDINATOR = "coordinator"
"""A device's one route: its coordinator."""
REPLACED = 4000
"""Close code of a connection the server closed because another connection of the same device replaced it."""
LOGIN_CHECK = "check"
"""The query that asks the server to check a login without opening a WebSocket (``device-agent doctor``)."""


@dataclass(frozen=True)
class Dial:
    """Where and as whom a device connects."""

    url: str
    """``wss://host:port`` (or ``ws://`` for a development server without TLS)."""
    fleet: str
    device: str
    password: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    @property
    def uri(self) -> str:
        return f"{self.url.rstrip('/')}/{self.fleet}/{self.device}"

    @property
    def tls(self) -> bool:
        return self.url.startswith("wss://")

    def ssl_context(self) -> ssl.SSLContext | None:
        """The client's TLS context: the kit's CA (the system's without one) and its certificate."""
        if not self.tls:
            return None
        context = ssl.create_default_context(cafile=self.ca_file)
        if self.cert_file:
            context.load_cert_chain(self.cert_file, self.key_file)
        return context

    def headers(self) -> dict[str, str]:
        if self.password is None:
            return {}
        login = base64.b64encode(f"{self.device}:{self.password}".encode()).decode()
        return {"Authorization": f"Basic {login}"}


class WsClient:
    """Keeps one WebSocket to the coordinator open (reconnecting) and feeds ``endpoint`` its frames."""

    def __init__(self, dial: Dial, endpoint: Endpoint, on_connected: Callable[[], None] | None = None) -> None:
        self.dial = dial
        self.endpoint = endpoint
        self.on_connected = on_connected
        self.refused: str | None = None
        """Why the coordinator refused this device's login, once it has; the client then stops trying."""
        self.connect_failure: str | None = None
        """Why the last attempt to connect failed, said once per outage."""
        self.connected = threading.Event()
        self._stopping = threading.Event()
        self._connection: ClientConnection | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._context = self.dial.ssl_context()  # unreadable kit files fail here, at start
        self.endpoint.start()
        self._thread = threading.Thread(target=self._run, name=f"fedfleet-ws-{self.dial.device}", daemon=True)
        self._thread.start()

    def stop(self, settle_s: float = 1.0) -> None:
        """Close the connection once what is queued is written (up to ``settle_s``), and stop."""
        self._stopping.set()
        deadline = time.monotonic() + settle_s
        while self.endpoint.window.in_window and time.monotonic() < deadline:
            time.sleep(0.02)
        self.endpoint.flush(COORDINATOR, max(0.0, deadline - time.monotonic()))  # a goodbye goes before the close
        connection = self._connection
        if connection is not None:
            connection.close(1000, "device stopping")
        self.endpoint.stop()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        settings = self.endpoint.settings
        delay = settings.reconnect_min_s
        while not self._stopping.is_set():
            try:
                connection = self._connect()
            except Exception as exc:  # never let the one thread that keeps the device connected die
                log.exception("%s: unexpected error connecting to %s", self.dial.device, self.dial.url)
                self._failed(f"{type(exc).__name__}: {exc}")
                connection = None
            if connection is None:
                if self.refused is not None:
                    return
                self._stopping.wait(delay * random.uniform(0.5, 1.0))
                delay = min(settings.reconnect_max_s, delay * 2)
                continue
            if self._serve(connection) != REPLACED:
                delay = settings.reconnect_min_s
                continue
            # Another connection with this login took over (a second agent with this kit): back off, as after a
            # failure, so that two of them do not replace each other as fast as they can.
            self._stopping.wait(delay * random.uniform(0.5, 1.0))
            delay = min(settings.reconnect_max_s, delay * 2)

    def _connect(self) -> ClientConnection | None:
        settings = self.endpoint.settings
        try:
            return connect(
                self.dial.uri,
                ssl=self._context,
                additional_headers=self.dial.headers(),
                compression=None,  # chunks are model bytes: deflate would cost CPU for nothing
                max_size=settings.limits.max_packet_bytes,
                ping_interval=settings.keepalive_s,
                ping_timeout=settings.keepalive_s,
                open_timeout=10,
                close_timeout=2,
            )
        except InvalidStatus as exc:
            status = exc.response.status_code
            body = exc.response.body.decode(errors="replace").strip() if exc.response.body else ""
            if status in (401, 403):
                self.refused = f"the coordinator refused the login of {self.dial.device} (HTTP {status}: {body})"
                log.error("%s: %s", self.dial.device, self.refused)
                return None
            self._failed(f"HTTP {status} from {self.dial.url}: {body or 'not a fedfleet WebSocket server?'}")
        except InvalidURI as exc:
            self.refused = f"transport.url: {exc}"
        except InvalidHandshake as exc:  # TLS 1.3: a refused certificate can also end the HTTP request unanswered
            cause = exc.__cause__
            if isinstance(cause, ssl.SSLError):
                self._refused_certificate(cause)
            elif isinstance(cause, EOFError | ConnectionError) and self.dial.cert_file is not None:
                self._closed_after_tls()
            else:
                self._failed(f"the WebSocket handshake with {self.dial.url} failed: {exc}")
        except ssl.SSLCertVerificationError as exc:
            self._failed(self._tls_problem() or f"TLS: {exc.verify_message or exc}")
        except ConnectionClosed as exc:  # TLS 1.3: the server's verdict on our certificate comes after our handshake
            cause = exc.__cause__
            if isinstance(cause, ssl.SSLError):
                self._refused_certificate(cause)
            elif self.dial.cert_file is not None:
                self._closed_after_tls()
            else:
                self._failed(f"{self.dial.url} closed the connection during the handshake ({exc})")
        except ssl.SSLError as exc:
            self._refused_certificate(exc)
        except (OSError, TimeoutError) as exc:
            self._failed(f"{self.dial.url} unreachable: {exc}")
        return None

    def _closed_after_tls(self) -> None:
        self._failed(
            f"TLS handshake with {self.dial.url} failed: the coordinator closed the connection after it: "
            "it refused this device's client certificate (not signed by the fleet's CA, revoked, or not "
            "this device's: transport.cert_file must be the one its kit carries)"
        )

    def _refused_certificate(self, exc: ssl.SSLError) -> None:
        self._failed(
            f"TLS handshake with {self.dial.url} failed: {exc.reason or exc} (the server refused this "
            "device's client certificate? transport.cert_file must be the one its kit carries)"
        )

    def _tls_problem(self) -> str | None:
        """The classified cause of a failed server verification (clock, CA, host name), as doctor says it."""
        parts = urlsplit(self.dial.url)
        problem = why_tls_fails(
            parts.hostname or "", parts.port or 443, self.dial.ca_file, self.dial.cert_file, self.dial.key_file
        )
        return None if problem is None else str(problem)

    def _failed(self, why: str) -> None:
        if why != self.connect_failure:
            log.warning("%s: cannot connect to %s: %s; retrying", self.dial.device, self.dial.url, why)
        self.connect_failure = why

    def _serve(self, connection: ClientConnection) -> int | None:
        """Feed ``connection``'s frames to the endpoint until it closes; its close code."""
        self._connection = connection
        self.connect_failure = None
        pipe = self.endpoint.attach(COORDINATOR, connection.send)
        self.connected.set()
        log.info("%s: connected to %s", self.dial.device, self.dial.url)
        if self.on_connected is not None:
            self.on_connected()
        try:
            for data in connection:
                self.endpoint.receive(COORDINATOR, data)
        except ConnectionClosed:
            pass
        finally:
            self.connected.clear()
            self.endpoint.detach(COORDINATOR, pipe)
            self._connection = None
        code = connection.close_code
        if not self._stopping.is_set():
            why = connection.close_reason or "no reason given"
            log.warning("%s: connection to %s lost (%s: %s); reconnecting", self.dial.device, self.dial.url, code, why)
        return code


def check_login(dial: Dial, timeout: float) -> tuple[bool, str]:
    """Whether the coordinator accepts this device's certificate and password, asked without opening a WebSocket
    (a running agent's connection is not replaced): (accepted, what the server said or why it could not)."""
    try:
        with connect(
            f"{dial.uri}?{LOGIN_CHECK}", ssl=dial.ssl_context(), additional_headers=dial.headers(), open_timeout=timeout
        ):
            return False, "the server opened a WebSocket instead of answering the check: not a fedfleet coordinator?"
    except InvalidStatus as exc:
        body = exc.response.body.decode(errors="replace").strip() if exc.response.body else ""
        status = exc.response.status_code
        return status == 200, body if status == 200 else f"HTTP {status}: {body or 'refused'}"
    except ConnectionClosed:
        return False, "the coordinator closed the connection after the TLS handshake: it refused the client certificate"
    except (InvalidHandshake, OSError, TimeoutError) as exc:
        return False, f"{type(exc).__name__}: {exc}"
