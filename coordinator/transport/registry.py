"""Transports by name: how the coordinator reaches its devices is a plugin, registered like a strategy.

fleet.yaml's ``transport.kind`` names a :class:`Transport` in :data:`TRANSPORTS`. The built-in ones are in
:mod:`coordinator.transport.kinds` (``mqtt``, the default: a broker and agents on it; ``in_process``: real
agents in this process over memory, what ``simulate()`` runs); another installed package adds one under the
entry point group ``fedfleet.transports`` (a module that calls ``TRANSPORTS.register(name, transport)``),
with no edit of fedfleet itself. A transport gives ``coordinator start`` its :class:`Services` (what must
run beside the coordinator, e.g. a managed broker, and the engine's :class:`~coordinator.transport.link.Link`)
and ``simulate()`` a link to in-memory devices; it may do one and refuse the other in :meth:`Transport.problems`.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import BaseModel, ValidationError

from coordinator.transport.broker.credentials import Credentials
from coordinator.transport.link import Link
from coordinator.transport.memory_link import LocalDevice
from device_agent.common.registry import Registry
from device_agent.common.validation import describe

if TYPE_CHECKING:
    from coordinator.config.fleet import Fleet

ENTRY_POINT_GROUP = "fedfleet.transports"


class UnsupportedTransport(ValueError):
    """A transport was asked for what it does not do (``problems()`` says so first; this is the last word)."""


@dataclass(frozen=True)
class FleetSetup:
    """What ``coordinator start`` has made for a run before its transport starts."""

    fleet: Fleet
    run_dir: Path
    credentials: Mapping[str, Credentials] = field(default_factory=dict)
    """Each login the kits hold (the coordinator's and every device's)."""
    tls: Mapping[str, str] = field(default_factory=dict)
    """The coordinator's CA and client certificate files from the kits, when the fleet uses TLS."""
    broker_config: Path | None = None
    """The broker configuration the kits carry (a managed TLS broker runs from it)."""
    plain_fallback: bool = False
    """Every process is on this host (emulation): a development fallback beats a refusal."""


class Services(Protocol):
    """What runs beside the coordinator for one run (a managed broker; possibly nothing), and its Link."""

    failure: str | None
    """Why the services gave up while the run went on (a broker that could not be restarted), else None."""

    def start(self) -> None:
        """Start; raises ``ConnectionError`` or ``RuntimeError`` subclasses with a message for the operator."""
        ...

    def stop(self) -> None: ...

    def describe(self) -> str:
        """The start-up line: where devices reach this coordinator."""
        ...

    def link(self) -> Link:
        """The engine's Link, once started."""
        ...

    def on_give_up(self, stop: Callable[[str], None]) -> None:
        """Call ``stop(why)`` if the services fail for good while the run goes on."""
        ...


@dataclass(frozen=True)
class DeviceFiles:
    """Where a device's kit files are once installed: what its agent.yaml names (None: the kit has no such file)."""

    password: str
    """The device's login, a secret reference (``file:`` in the kit, or fleet.yaml's own reference)."""
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    doctor: Mapping[str, str] | None = None
    """The device's read-only doctor login (``password``, and ``cert_file``/``key_file`` with TLS), if any."""


class Transport:
    """One way of reaching devices. Override what it supports; :meth:`problems` says what it does not.

    The kit methods (:meth:`kit_tls`, :meth:`server_names`, :meth:`dial_url`, :meth:`agent_settings`) are what
    ``coordinator provision`` asks of the fleet's transport; by default they make MQTT's kit (a broker section).
    """

    settings: type[BaseModel] | None = None
    """The model of this transport's own keys in fleet.yaml's ``transport:`` (beside ``kind`` and ``broker``);
    None: it has none, and any such key is refused."""

    def options(self, fleet: Fleet) -> BaseModel | None:
        """This transport's own settings from ``fleet``, validated (``settings_problems`` says what is wrong)."""
        return None if self.settings is None else self.settings.model_validate(fleet.transport.options)

    def problems(self, fleet: Fleet, simulation: bool = False) -> list[str]:
        """One line per reason this transport cannot run ``fleet`` (``simulation``: under ``simulate()``),
        each starting with the fleet.yaml key to fix."""
        return []

    def settings_problems(self, fleet: Fleet) -> list[str]:
        """One line per wrong key among this transport's own settings (fleet.yaml's ``transport:`` keys besides
        ``kind`` and ``broker``), each with its key path; without a ``settings`` model it takes none."""
        options = fleet.transport.options
        if self.settings is None:
            return [
                f"transport.{key}: not a setting of transport {fleet.transport.kind!r} (it takes kind and broker)"
                for key in sorted(options)
            ]
        try:
            self.settings.model_validate(options)
        except ValidationError as exc:
            return describe(exc, prefix="transport", sep="\n", model=self.settings).splitlines()
        return []

    def kit_tls(self, fleet: Fleet) -> bool:
        """Whether provisioning makes the fleet's certificates (a server certificate, one per participant)."""
        return fleet.broker.tls and fleet.broker.mode == "managed"

    def server_names(self, fleet: Fleet) -> list[str]:
        """The names the server certificate covers: broker.hosts, the listen address, and loopback (emulation)."""
        return named_hosts(fleet.broker.hosts, fleet.broker.host)

    def dial_url(self, fleet: Fleet) -> str:
        """The URL devices dial: an external broker's, else the first of broker.hosts (else the listen address)."""
        broker = fleet.broker
        if broker.mode == "external":
            assert broker.url is not None
            return broker.url
        return f"{'mqtts' if broker.tls else 'mqtt'}://{dialled_host(broker.hosts, broker.host)}:{broker.port}"

    def agent_settings(self, fleet: Fleet, files: DeviceFiles) -> dict[str, Any]:
        """The sections of a device's agent.yaml that say how it reaches the coordinator."""
        broker: dict[str, Any] = {"url": self.dial_url(fleet), "password": files.password}
        if files.cert_file is not None:
            broker |= {"ca_file": files.ca_file, "cert_file": files.cert_file, "key_file": files.key_file}
        if files.doctor is not None:
            broker["doctor"] = dict(files.doctor)
        return {"transport": {"kind": "mqtt", "broker": broker}}

    def services(self, setup: FleetSetup) -> Services:
        """The services of a real run (``coordinator start``)."""
        raise UnsupportedTransport(f"transport.kind: {type(self).__name__} does not run a fleet (coordinator start)")

    def simulation_link(self, fleet: Fleet, devices: Sequence[LocalDevice], **options: Any) -> Link:
        """The Link of devices whose data is in this process (``simulate()``)."""
        raise UnsupportedTransport(f"transport.kind: {type(self).__name__} does not run a simulation")


def named_hosts(hosts: Sequence[str], listen: str) -> list[str]:
    """A server certificate's names: the ``hosts`` devices dial, a specific listen address, and loopback."""
    names = [*hosts]
    if listen not in ("0.0.0.0", "::"):
        names.append(listen)
    return list(dict.fromkeys([*names, "localhost", "127.0.0.1"]))


def dialled_host(hosts: Sequence[str], listen: str) -> str:
    """The host a kit's device dials: the first of ``hosts``, else a specific listen address, else this host's name."""
    return hosts[0] if hosts else listen if listen not in ("0.0.0.0", "::") else socket.gethostname()


def transport_problems(fleet: Fleet, simulation: bool = False) -> list[str]:
    """Everything that keeps ``fleet``'s transport from running: an unknown kind, wrong settings, its own checks."""
    try:
        transport = transport_of(fleet)
    except ValueError as exc:
        return [str(exc)]
    return transport.settings_problems(fleet) or transport.problems(fleet, simulation)


TRANSPORTS: Registry[Transport] = Registry("transport", "coordinator.transport.kinds", ENTRY_POINT_GROUP)


def transport_of(fleet: Fleet) -> Transport:
    """The transport ``fleet.transport.kind`` names; an unknown one is an error listing those registered."""
    kind = fleet.transport.kind
    if kind not in TRANSPORTS:
        raise ValueError(
            f"transport.kind: {kind!r} is not a registered transport (registered: {', '.join(TRANSPORTS)}); "
            f"a package adds one under the entry point group {ENTRY_POINT_GROUP!r}"
        )
    return TRANSPORTS[kind]


__all__ = [
    "ENTRY_POINT_GROUP",
    "TRANSPORTS",
    "DeviceFiles",
    "FleetSetup",
    "Services",
    "Transport",
    "UnsupportedTransport",
    "dialled_host",
    "named_hosts",
    "transport_of",
    "transport_problems",
]
