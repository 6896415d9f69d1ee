"""``mqtt``, the default: devices are agents on an MQTT broker, managed by the coordinator or external.

Its services are the broker (mosquitto, or the amqtt development fallback, supervised and restarted if it
dies; an external broker is only connected to) and an :class:`~coordinator.transport.link.MqttLink` on it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coordinator.transport.broker.base import BrokerSettings, queue_limits
from coordinator.transport.broker.credentials import COORDINATOR_USER
from coordinator.transport.broker.factory import ExternalBroker, external_broker, make_broker
from coordinator.transport.broker.kit import KitBroker
from coordinator.transport.broker.mosquitto import find_mosquitto
from coordinator.transport.broker.scratch import scratch_dir
from coordinator.transport.broker.supervisor import PID_FILE, BrokerSupervisor
from coordinator.transport.link import Link, MqttLink
from coordinator.transport.memory_link import LocalDevice
from coordinator.transport.registry import TRANSPORTS, FleetSetup, Transport, UnsupportedTransport
from device_agent.common.schema import SecretError, resolve_secret
from device_agent.wire.session import BrokerAddress

if TYPE_CHECKING:
    from coordinator.config.fleet import Fleet


class BrokerServices:
    """The fleet's broker and the coordinator's MQTT link on it."""

    def __init__(self, setup: FleetSetup) -> None:
        self.setup = setup
        broker = _broker(setup)
        if not isinstance(broker, ExternalBroker):
            broker = BrokerSupervisor(broker, setup.run_dir / PID_FILE)
        self.broker = broker
        self.address: BrokerAddress | None = None

    @property
    def failure(self) -> str | None:
        return getattr(self.broker, "failure", None)

    @property
    def protocol(self) -> str:
        return self.broker.protocol

    def start(self) -> None:
        self.broker.start()
        self.address = self.broker.address_for(self.setup.credentials[COORDINATOR_USER])

    def stop(self) -> None:
        self.broker.stop()

    def describe(self) -> str:
        url = "?" if self.address is None else self.address.url
        return f"broker: {url} ({self.setup.fleet.broker.mode}, MQTT {self.broker.protocol})"

    def link(self) -> Link:
        if self.address is None:
            raise RuntimeError("the broker is not started")
        return MqttLink.of(self.setup.fleet, self.address, protocol=self.broker.protocol)

    def on_give_up(self, stop: Callable[[str], None]) -> None:
        if isinstance(self.broker, BrokerSupervisor):
            self.broker.on_give_up = stop


def _broker(setup: FleetSetup) -> Any:
    fleet, credentials = setup.fleet, setup.credentials
    settings = fleet.broker
    coordinator = credentials[COORDINATOR_USER]
    if settings.mode == "external":
        if settings.url is None:
            raise ValueError("transport.broker.url: an external broker needs its URL")
        ca = str(settings.ca_file) if settings.ca_file else None
        return external_broker(settings.url, coordinator.username, coordinator.password, ca)
    if settings.mode == "managed" and (settings.tls or find_mosquitto()) and setup.broker_config is not None:
        host = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
        tls = dict(setup.tls) if settings.tls else {}
        address = BrokerAddress(host, settings.port, coordinator.username, coordinator.password, bool(tls), **tls)
        return KitBroker(setup.broker_config, address)
    # mosquitto drops root to its own user: the work dir must be reachable by it (not under a 0700 home).
    workdir = scratch_dir(f"fedfleet-{fleet.fleet}-broker-")
    broker_settings = BrokerSettings(
        fleet.fleet,
        workdir,
        {COORDINATOR_USER: coordinator, **credentials},
        host=settings.host,
        port=settings.port,
        **queue_limits(len(fleet.devices)),
    )
    return make_broker(broker_settings, prefer="amqtt" if settings.mode == "amqtt" else "auto")


def broker_problems(fleet: Fleet) -> list[str]:
    """What keeps the fleet's broker from starting here (its secrets, CA file, mosquitto for TLS)."""
    broker = fleet.broker
    refs = [("transport.broker.password", broker.password)]
    refs += [(f"devices[{i}].credentials", d.credentials) for i, d in enumerate(fleet.devices)]
    problems = []
    for key, ref in refs:
        if ref is not None:
            try:
                resolve_secret(ref)
            except SecretError as exc:
                problems.append(f"{key}: {exc}")
    if broker.ca_file is not None and not Path(broker.ca_file).is_file():
        problems.append(f"transport.broker.ca_file: {broker.ca_file}: no such file")
    if broker.mode == "managed" and broker.tls and find_mosquitto() is None:
        problems.append(
            "transport.broker.tls: a managed TLS broker runs mosquitto, which is not installed here "
            "(apt install mosquitto); or set transport.broker.mode: amqtt for a plain development broker"
        )
    return problems


class Mqtt(Transport):
    def problems(self, fleet: Fleet, simulation: bool = False) -> list[str]:
        if simulation:
            return [
                "transport.kind: mqtt reaches agents on a broker; simulate() runs its devices in this process "
                "(kind: in_process), or give it a link"
            ]
        return self.settings_problems(fleet) + broker_problems(fleet)

    def services(self, setup: FleetSetup) -> BrokerServices:
        return BrokerServices(setup)

    def simulation_link(self, fleet: Fleet, devices: Sequence[LocalDevice], **options: Any) -> Link:
        raise UnsupportedTransport(self.problems(fleet, simulation=True)[0])


TRANSPORTS.register("mqtt", Mqtt())
