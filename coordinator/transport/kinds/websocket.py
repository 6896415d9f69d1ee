"""``websocket``: devices are agents on a WebSocket over TLS to the coordinator, for networks that pass only HTTPS.

fleet.yaml::

    transport: {kind: websocket, port: 8443, hosts: [coordinator.example.org]}

Its service is the coordinator's WebSocket server (``coordinator.transport.websocket``), with the certificates
provisioning makes for the fleet (the CA, the server certificate for ``hosts``, one client certificate per
device, the revocation list) and each device's password; no broker runs. Its kit gives each device an
agent.yaml ``transport: {kind: websocket, url: wss://HOST:PORT, ...}``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from coordinator.transport.broker.credentials import COORDINATOR_USER
from coordinator.transport.link import Link
from coordinator.transport.registry import TRANSPORTS, DeviceFiles, FleetSetup, Transport, dialled_host, named_hosts
from coordinator.transport.websocket.link import WebSocketLink
from coordinator.transport.websocket.server import ServerTls, WsServer
from device_agent.wire.websocket.endpoint import WsSettings

if TYPE_CHECKING:
    from coordinator.config.fleet import Fleet

# Where provisioning puts the fleet's server certificate and CA (kits/broker/: the same files an MQTT fleet's
# broker reads; see coordinator.provision.certificates).
SERVER_CERT, SERVER_KEY, CA_CERT, CRL = "server.pem", "server.key", "ca.pem", "crl.pem"


class WebSocketServerSettings(BaseModel):
    """fleet.yaml's ``transport:`` for kind ``websocket`` (every key but ``kind`` and the MQTT ``broker``)."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field("0.0.0.0", description="where the server listens")
    port: int = Field(8443, ge=1, le=65535, description="where the server listens (443 behind nothing else)")
    hosts: list[str] = Field(
        default_factory=list,
        description="names/IPs devices dial (the server certificate's names; the first is the one in each kit)",
    )
    tls: bool = Field(True, description="TLS with the fleet's certificates; false only for a development fleet")
    keepalive_s: float = Field(20.0, ge=5, le=3600, description="ping interval; twice this silent is a lost device")


def settings_of(fleet: Fleet) -> WebSocketServerSettings:
    return WebSocketServerSettings.model_validate(fleet.transport.options)


class WebSocketServices:
    """The fleet's WebSocket server and the engine's link on it."""

    failure: str | None = None

    def __init__(self, setup: FleetSetup) -> None:
        fleet = setup.fleet
        self.settings = settings_of(fleet)
        self.fleet = fleet
        tls = None
        if self.settings.tls:
            if setup.broker_config is None:
                raise ValueError("transport.tls: the kits hold no server certificate: provision the fleet first")
            folder = setup.broker_config.parent
            crl = folder / CRL
            revoked = str(crl) if crl.exists() else None
            tls = ServerTls(str(folder / SERVER_CERT), str(folder / SERVER_KEY), str(folder / CA_CERT), revoked)
        passwords = {name: login.password for name, login in setup.credentials.items() if name != COORDINATOR_USER}
        self.server = WsServer(
            fleet.fleet,
            self.settings.host,
            self.settings.port,
            passwords,
            tls,
            WsSettings(keepalive_s=self.settings.keepalive_s),
            fleet.inbound_limits(),
        )

    def start(self) -> None:
        try:
            self.server.start()
        except FileNotFoundError as exc:
            raise ConnectionError(
                f"transport.tls: {exc.filename} is missing: provision the kits again (coordinator provision)"
            ) from None
        except OSError as exc:
            raise ConnectionError(
                f"transport.port: cannot listen on {self.settings.host}:{self.settings.port}: {exc.strerror or exc}"
            ) from None

    def stop(self) -> None:
        self.server.stop()

    def describe(self) -> str:
        how = "TLS, client certificates and passwords" if self.settings.tls else "PLAIN, passwords only: development"
        return f"websocket: {self.server.url} ({how}); devices dial {WebSocket().dial_url(self.fleet)}"

    def link(self) -> Link:
        return WebSocketLink(self.server)

    def on_give_up(self, stop: Callable[[str], None]) -> None:
        """The server runs in this process: it fails with it, never on its own."""


class WebSocket(Transport):
    settings = WebSocketServerSettings

    def problems(self, fleet: Fleet, simulation: bool = False) -> list[str]:
        wrong = self.settings_problems(fleet)
        if wrong:
            return wrong
        if simulation:
            return [
                "transport.kind: websocket reaches agents over the network; simulate() runs its devices in "
                "this process (kind: in_process)"
            ]
        return []

    def services(self, setup: FleetSetup) -> WebSocketServices:
        return WebSocketServices(setup)

    def kit_tls(self, fleet: Fleet) -> bool:
        return settings_of(fleet).tls

    def server_names(self, fleet: Fleet) -> list[str]:
        settings = settings_of(fleet)
        return named_hosts(settings.hosts, settings.host)

    def dial_url(self, fleet: Fleet) -> str:
        settings = settings_of(fleet)
        return f"{'wss' if settings.tls else 'ws'}://{dialled_host(settings.hosts, settings.host)}:{settings.port}"

    def agent_settings(self, fleet: Fleet, files: DeviceFiles) -> dict[str, Any]:
        transport: dict[str, Any] = {"kind": "websocket", "url": self.dial_url(fleet), "password": files.password}
        if files.cert_file is not None:
            transport |= {"ca_file": files.ca_file, "cert_file": files.cert_file, "key_file": files.key_file}
        keepalive = settings_of(fleet).keepalive_s
        if keepalive != WebSocketServerSettings.model_fields["keepalive_s"].default:
            transport["keepalive_s"] = keepalive
        return {"transport": transport}


TRANSPORTS.register("websocket", WebSocket())

__all__ = ["WebSocket", "WebSocketServerSettings", "WebSocketServices", "settings_of"]
