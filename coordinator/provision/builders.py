"""Provisioning as a list of builders, run in order by ``provision()``, each writing one part of the kits.

A builder reads the fleet and what the builders before it left on the :class:`Provisioning` it is
handed (the logins, the CA, the agent wheel) and adds its part. Another kit set is another list,
not another branch in ``provision()``: a builder that drops a site's own file into every kit goes
at the end of :data:`BUILDERS`. Each builder keeps what is already there (see the modules it calls),
so running the list again refreshes the kits without changing a deployed device's secrets.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from coordinator.config.fleet import Fleet
from coordinator.provision.agent_kit import broker_url, build_agent_kit
from coordinator.provision.broker_files import build_broker_files
from coordinator.provision.bundle import build_bundle
from coordinator.provision.certificates import Authority, build_certificates, build_doctor_certificates
from coordinator.provision.device_wheels import WheelOptions, build_device_wheels
from coordinator.provision.layout import MANIFEST, DeviceLayout, Kits
from coordinator.provision.secrets import ProvisionError, build_credentials, build_doctor_credentials
from coordinator.provision.signing_keys import build_signing_keys
from coordinator.provision.wheel import build_agent_wheel
from coordinator.transport.broker.credentials import COORDINATOR_USER, Credentials, write_file
from coordinator.transport.registry import transport_of

T = TypeVar("T")


@dataclass
class Provisioning:
    """One provisioning run: its inputs, and what builders made that later builders need."""

    fleet: Fleet
    kits: Kits
    layout: DeviceLayout
    rotate: Collection[str] = ()
    broker_dir: Path | None = None
    credentials: dict[str, Credentials] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)
    doctors: dict[str, Credentials] = field(default_factory=dict)
    authority: Authority | None = None
    wheel: Path | None = None
    wheels: WheelOptions | None = None
    wheels_done: dict[str, str] = field(default_factory=dict)

    @property
    def tls(self) -> bool:
        """Whether the kits carry certificates, as the fleet's transport says (``mqtt``: only for a broker we run:
        an external one has its own)."""
        return transport_of(self.fleet).kit_tls(self.fleet)

    @property
    def participants(self) -> list[str]:
        return [COORDINATOR_USER, *(d.id for d in self.fleet.devices)]

    @property
    def logins(self) -> dict[str, str]:
        """Participant -> its broker user name (a device's is its id), the CN of its certificate."""
        return {name: self.fleet.broker.username if name == COORDINATOR_USER else name for name in self.participants}


@dataclass(frozen=True)
class Builder:
    """A named step of provisioning; the name is what an error about a misordered list points at."""

    name: str
    build: Callable[[Provisioning], None]


def _made(value: T | None, what: str, by: str, builder: str) -> T:
    if value is None:
        raise ProvisionError(f"builder {builder!r} needs {what}, made by builder {by!r}: put that one before it")
    return value


def credentials(run: Provisioning) -> None:
    run.credentials, run.missing = build_credentials(run.fleet, run.kits, run.rotate)


def doctor_logins(run: Provisioning) -> None:
    """Each device's read-only login for ``device-agent doctor`` (a broker we run only)."""
    run.doctors = build_doctor_credentials(run.fleet, run.kits, run.rotate)


def signing_keys(run: Provisioning) -> None:
    build_signing_keys(run.fleet, run.kits, run.rotate)


def certificates(run: Provisioning) -> None:
    """The CA always (its revocation list goes to the broker), certificates only with TLS (CN = login)."""
    run.authority = Authority(run.kits, run.fleet.fleet)
    if run.tls:
        names = transport_of(run.fleet).server_names(run.fleet)
        build_certificates(run.authority, run.kits, names, run.logins, run.rotate)
        logins = {device: credentials.username for device, credentials in run.doctors.items()}
        build_doctor_certificates(run.authority, run.kits, logins, run.rotate)


def broker_files(run: Provisioning) -> None:
    authority = _made(run.authority, "the CA", "certificates", "broker files")
    build_broker_files(run.fleet, run.kits, run.credentials, authority, run.broker_dir, run.doctors)


def agent_wheel(run: Provisioning) -> None:
    run.wheel = build_agent_wheel(run.kits.root / "wheels")


def agent_kits(run: Provisioning) -> None:
    """A device whose password fleet.yaml names but cannot be read now gets that reference in its agent.yaml."""
    wheel = _made(run.wheel, "the agent wheel", "agent wheel", "agent kits")
    for index, device in enumerate(run.fleet.devices):
        password_ref = device.credentials if device.id in run.missing else None
        build_agent_kit(run.fleet, index, run.kits, wheel, run.layout, password_ref, device.id in run.doctors)


def device_wheels(run: Provisioning) -> None:
    """``--wheels``: each kit's wheels/ for its device's platform (nothing without the option)."""
    if run.wheels is not None:
        run.wheels_done = build_device_wheels(run.fleet, run.kits.root, run.wheels)


def bundles(run: Provisioning) -> None:
    for device in run.fleet.devices:
        build_bundle(run.kits.participant(device.id), run.kits.bundle(device.id))


def manifest(run: Provisioning) -> None:
    """fleet.json: which fleet these kits are for, so ``coordinator start`` never reads another fleet's logins."""
    devices = [d.id for d in run.fleet.devices]
    facts = {"fleet": run.fleet.fleet, "broker_url": broker_url(run.fleet), "tls": run.tls, "devices": devices}
    write_file(run.kits.root / MANIFEST, json.dumps(facts, indent=2) + "\n", 0o644)


BUILDERS: tuple[Builder, ...] = (
    Builder("credentials", credentials),
    Builder("doctor logins", doctor_logins),
    Builder("signing keys", signing_keys),
    Builder("certificates", certificates),
    Builder("broker files", broker_files),
    Builder("agent wheel", agent_wheel),
    Builder("agent kits", agent_kits),
    Builder("device wheels", device_wheels),
    Builder("bundles", bundles),
    Builder("manifest", manifest),
)
