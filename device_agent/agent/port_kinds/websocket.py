"""``websocket``: the device's WebSocket over TLS to its coordinator, for networks that pass only HTTPS.

agent.yaml::

    transport: {kind: websocket, url: "wss://coordinator.example.org:8443", password: "file:password",
                ca_file: ca.pem, cert_file: client.pem, key_file: client.key}

The frames and transfers are MQTT's (``device_agent.wire.websocket``); the server gives this connection the
device's own route, so nothing it sends can speak for another device. A closed connection is the device's
``offline`` (MQTT's last will), said by the server.
"""

from __future__ import annotations

import ssl
import time
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from device_agent.agent.config import AgentConfig, ConfigError
from device_agent.agent.port import CoordinatorPort, MessageHandler, PayloadHandler, Signer, Upload
from device_agent.agent.ports import PORTS, Finding, PortKind
from device_agent.common.schema import SecretError, check_secret_ref, resolve_secret
from device_agent.common.validation import describe
from device_agent.wire.engine.manifests import make_manifest
from device_agent.wire.messages import Message, Status
from device_agent.wire.reachability import wait_for_broker, why_unreachable
from device_agent.wire.tls_errors import why_tls_fails
from device_agent.wire.websocket.client import COORDINATOR, Dial, WsClient, check_login
from device_agent.wire.websocket.endpoint import Endpoint, WsSettings
from device_agent.wire.websocket.pipe import ChunkHook


class WebSocketSettings(BaseModel):
    """agent.yaml's ``transport:`` for kind ``websocket`` (every key but ``kind``)."""

    model_config = ConfigDict(extra="forbid")

    kind: str = "websocket"
    url: str = Field(description="wss://host:port of the coordinator (ws:// only for a development server)")
    password: str | None = Field(None, description="this device's login as a reference: file:PATH or env:NAME")
    ca_file: str | None = Field(None, description="the fleet's CA (the kit's ca.pem); default: the system's CAs")
    cert_file: str | None = Field(None, description="this device's client certificate (the kit's client.pem)")
    key_file: str | None = None
    keepalive_s: float = Field(20.0, ge=5, le=3600, description="ping interval; twice this silent is a lost link")

    @field_validator("url")
    @classmethod
    def _url(cls, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme not in ("ws", "wss") or not parts.hostname:
            raise ValueError(f"must look like wss://host:port, got {url!r}")
        try:
            parts.port  # noqa: B018 - raises on a port that is not a number
        except ValueError:
            raise ValueError(f"{url!r}: the port must be a number from 1 to 65535") from None
        if parts.path not in ("", "/"):
            raise ValueError(f"{url!r}: no path (the device's own path is added when it connects)")
        return url

    @field_validator("password")
    @classmethod
    def _reference(cls, ref: str | None) -> str | None:
        return check_secret_ref(ref)

    @model_validator(mode="after")
    def _client_certificate(self) -> WebSocketSettings:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("transport.cert_file and transport.key_file go together (a certificate and its key)")
        if self.cert_file is not None and not self.url.startswith("wss://"):
            raise ValueError("a client certificate (transport.cert_file) needs a wss:// url")
        return self

    @property
    def host_port(self) -> tuple[str, int]:
        parts = urlsplit(self.url)
        return parts.hostname or "", parts.port or (443 if parts.scheme == "wss" else 80)


def _tls_files(settings: WebSocketSettings) -> tuple[str | None, str | None, str | None]:
    return settings.ca_file, settings.cert_file, settings.key_file


def settings_of(config: AgentConfig) -> WebSocketSettings:
    return WebSocketSettings.model_validate({"kind": config.transport.kind, **(config.transport.model_extra or {})})


class WsPort:
    """The device's :class:`~device_agent.agent.port.CoordinatorPort` over one WebSocket."""

    def __init__(
        self, config: AgentConfig, before_chunk_out: ChunkHook | None = None, after_chunk_in: ChunkHook | None = None
    ) -> None:
        settings = settings_of(config)
        password = None
        if settings.password is not None:
            try:
                password = resolve_secret(settings.password)
            except SecretError as exc:
                raise ConnectionError(f"transport.password: {exc}") from None
        self.dial = Dial(settings.url, config.fleet, config.device, password, *_tls_files(settings))
        self.where = settings.url
        self.device = config.device
        self.connect_timeout_s = config.connect_timeout_s
        self._wire = WsSettings(keepalive_s=settings.keepalive_s)
        self._hooks = before_chunk_out, after_chunk_in
        self._client: WsClient | None = None
        self._give_up: float | None = None

    def start(self, on_message: MessageHandler, on_payload: PayloadHandler, timeout: float | None = None) -> None:
        """Start connecting and return at once; never connected ``timeout`` s later, :meth:`fatal` says why."""
        endpoint = Endpoint(
            f"fedfleet-{self.dial.fleet}-{self.device}",
            self._wire,
            on_message=lambda _route, message: on_message(message),
            on_payload=lambda _route, completed: on_payload(completed.manifest.transfer, completed.data),
            before_chunk_out=self._hooks[0],
            after_chunk_in=self._hooks[1],
        )
        self._client = WsClient(self.dial, endpoint)
        try:
            self._client.start()
        except OSError as exc:  # ssl.SSLError included: the kit's CA, certificate or key cannot be used
            raise ConnectionError(f"transport.ca_file, cert_file or key_file cannot be used: {exc}") from None
        self._give_up = None if timeout is None else time.monotonic() + timeout

    def stop(self) -> None:
        """Leave the fleet: say ``offline`` (stopped) first, so the server need not report a lost connection."""
        if self._client is not None:
            self._client.endpoint.publish(COORDINATOR, Status(device=self.device, state="offline", detail="stopped"))
            self._client.stop()

    def publish(self, message: Message, retain: bool = False) -> None:
        """Send a control message now, or drop it while disconnected: the agent announces itself after every
        connect, and the server keeps each device's last hello and status for a coordinator that attaches later."""
        self._started().endpoint.publish(COORDINATOR, message)

    def send(self, payload: bytes, sign: Signer | None = None, **fields: Any) -> Upload:
        endpoint = self._started().endpoint
        if sign is None:
            return endpoint.send(COORDINATOR, payload, **fields)
        manifest = make_manifest(payload, self._wire.chunk_size, limits=self._wire.limits, **fields)
        manifest = manifest.model_copy(update={"meta": sign(manifest.digest, manifest.meta)})  # type: ignore[arg-type]
        return endpoint.send(COORDINATOR, payload, manifest=manifest, transfer=fields.get("transfer"))

    def cancel(self, transfer: str) -> None:
        self._started().endpoint.cancel(lambda manifest: manifest.transfer == transfer, "superseded by a newer round")

    @property
    def connects(self) -> int:
        return 0 if self._client is None else self._client.endpoint.stats.connects

    def fatal(self) -> str | None:
        client = self._started()
        if client.refused:
            return f"{client.refused}; check the device's transport.password and its kit"
        if self._give_up is not None and self.connects == 0 and time.monotonic() > self._give_up:
            return (
                f"could not connect to {self.where} within {self.connect_timeout_s:g} s (connect_timeout_s): "
                f"{client.connect_failure or 'no answer from the coordinator'}"
            )
        return None

    def _started(self) -> WsClient:
        if self._client is None:
            raise RuntimeError("the WebSocket port is not started")
        return self._client


class WebSocket(PortKind):
    def problems(self, config: AgentConfig) -> list[str]:
        try:
            settings_of(config)
        except ValidationError as exc:
            return describe(exc, prefix="transport", model=WebSocketSettings, sep="\n").splitlines()
        return []

    def port(
        self, config: AgentConfig, before_chunk_out: ChunkHook | None = None, after_chunk_in: ChunkHook | None = None
    ) -> CoordinatorPort:
        return WsPort(config, before_chunk_out, after_chunk_in)

    def preflight(self, config: AgentConfig, give_up_s: float) -> None:
        """Wait for the coordinator's TCP port: the agent may start before the coordinator (a boot)."""
        host, port = settings_of(config).host_port
        wait_for_broker(host, port, give_up_s, what="the coordinator")

    def doctor(self, config: AgentConfig, timeout: float) -> list[Finding]:
        """The kit's secrets, the coordinator's port, its certificate against the kit's CA, and the login (checked
        by the server without opening a WebSocket, so a running agent keeps its connection)."""
        settings = settings_of(config)
        try:
            password = None if settings.password is None else resolve_secret(settings.password)
            dial = Dial(settings.url, config.fleet, config.device, password, *_tls_files(settings))
            dial.ssl_context()
            config.resolve_signing_key()
        except (SecretError, ConfigError, OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            detail = f"transport: {exc}" if isinstance(exc, SecretError | ssl.SSLError) else str(exc)
            return [Finding("secrets readable", False, detail, "run doctor as the agent's user (sudo) or fix the path")]
        read = "password" + (", CA, client certificate" if settings.cert_file else "")
        findings = [Finding("secrets readable", True, read + (", signing key" if config.signing_key else ""))]
        host, port = settings.host_port
        why = why_unreachable(host, port, timeout)
        if why is not None:
            hint = "is the coordinator started, and transport.url its address? (behind a proxy: HTTPS_PROXY)"
            return [*findings, Finding("coordinator reachable", False, f"{host}:{port}: {why}", hint)]
        findings.append(Finding("coordinator reachable", True, f"{host}:{port}"))
        if dial.tls:
            problem = why_tls_fails(host, port, settings.ca_file, settings.cert_file, settings.key_file, timeout)
            if problem is not None:
                return [*findings, Finding("TLS verifies", False, problem.reason, problem.hint)]
            findings.append(
                Finding("TLS verifies", True, f"server certificate for {host} signed by {settings.ca_file}")
            )
        accepted, said = check_login(dial, timeout)
        hint = "the kit's password or certificate is not this device's current one: provision again, copy the new kit"
        return [*findings, Finding("login accepted", accepted, f"as {config.device}: {said}", hint)]

    def claim_key(self, config: AgentConfig) -> str:
        """One login on one coordinator: a second connection with it would replace the first."""
        host, port = settings_of(config).host_port
        return f"websocket:{host}:{port}/{config.fleet}/{config.device}"


PORTS.register("websocket", WebSocket())
