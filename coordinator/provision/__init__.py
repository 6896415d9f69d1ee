"""``coordinator provision``: fleet.yaml in, one startup kit per participant out, as a list of builders.

credentials -> signing keys -> certificates -> broker files -> agent wheel -> agent kits -> device wheels
-> bundles
-> manifest (:data:`~coordinator.provision.builders.BUILDERS`). Every builder keeps what is
already there, so provisioning again (after adding a device, or changing broker.hosts) never
changes a deployed device's secrets; ``rotate`` replaces the named participants' password and
certificate (and revokes the old certificate) and rewrites the broker files. Credentials belong to
the fleet's kits, not to a run: every ``coordinator start`` of the fleet reads them from here.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

from coordinator.config.fleet import Fleet
from coordinator.provision.agent_kit import broker_url
from coordinator.provision.builders import BUILDERS, Builder, Provisioning
from coordinator.provision.device_wheels import WheelOptions
from coordinator.provision.layout import (
    CA_CERT,
    CLIENT_CERT,
    CLIENT_KEY,
    MANIFEST,
    PASSWORD,
    DeviceLayout,
    Kits,
    private_dir,
)
from coordinator.provision.secrets import ProvisionError
from coordinator.transport.broker.credentials import COORDINATOR_USER, Credentials
from device_agent.common.schema import SecretError, resolve_secret


@dataclass(frozen=True)
class Provisioned:
    """What a provisioning run produced, for the CLI and for ``coordinator start``."""

    kits: Kits
    credentials: dict[str, Credentials]
    broker_url: str
    tls: bool
    rotated: tuple[str, ...]
    missing: dict[str, str]
    wheels: dict[str, str]


def provision(
    fleet: Fleet,
    out: Path,
    rotate: Collection[str] = (),
    layout: DeviceLayout | None = None,
    broker_dir: Path | None = None,
    builders: Sequence[Builder] = BUILDERS,
    wheels: WheelOptions | None = None,
) -> Provisioned:
    """Build (or refresh) every kit of ``fleet`` under ``out`` by running ``builders`` in order;
    ``wheels`` fills each kit's wheels/ for its platform (``--wheels``)."""
    known = {COORDINATOR_USER, *(d.id for d in fleet.devices)}
    unknown = sorted(set(rotate) - known)
    if unknown:
        raise ProvisionError(f"--rotate {', '.join(unknown)}: not in fleet {fleet.fleet} ({', '.join(sorted(known))})")
    kits = Kits(private_dir(out, 0o711))
    run = Provisioning(fleet, kits, layout or DeviceLayout(), rotate, broker_dir, wheels=wheels)
    for builder in builders:
        builder.build(run)
    return Provisioned(
        run.kits, run.credentials, broker_url(fleet), run.tls, tuple(rotate), run.missing, run.wheels_done
    )


def default_kits(fleet_file: Path, fleet: Fleet) -> Path:
    """Where a fleet's kits live unless told: next to its fleet.yaml, ``kits/<fleet>/``."""
    return Path(fleet_file).parent / "kits" / fleet.fleet


def read_credentials(fleet: Fleet, kits: Kits) -> dict[str, Credentials]:
    """Every login of ``fleet`` from its kits (or fleet.yaml's references); never generates one."""
    manifest = kits.root / MANIFEST
    if manifest.exists() and json.loads(manifest.read_text()).get("fleet") != fleet.fleet:
        raise ProvisionError(f"{kits.root} holds the kits of another fleet (see {manifest}), not of {fleet.fleet}")
    refs = {COORDINATOR_USER: (fleet.broker.password, "broker.password")}
    refs |= {d.id: (d.credentials, f"devices[{i}].credentials") for i, d in enumerate(fleet.devices)}
    credentials = {}
    for name, (ref, what) in refs.items():
        path = kits.participant(name) / PASSWORD
        try:
            secret = resolve_secret(ref) if ref is not None else path.read_text().strip()
        except SecretError as exc:
            raise ProvisionError(f"{what}: {exc}") from None
        except OSError:
            raise ProvisionError(
                f"{name} has no password in {kits.root}: provision it (coordinator provision --out {kits.root})"
            ) from None
        credentials[name] = Credentials(fleet.broker.username if name == COORDINATOR_USER else name, secret)
    return credentials


def lacks_tls(fleet: Fleet, kits: Kits) -> bool:
    """Whether ``kits`` were provisioned without TLS for a fleet whose managed broker has it.

    ``coordinator emulate`` on a machine without mosquitto provisions the demo's kits for its plain
    amqtt fallback; once mosquitto is installed the same kits would keep the fleet on plain MQTT.
    """
    manifest = kits.root / MANIFEST
    if not manifest.exists() or not (fleet.broker.mode == "managed" and fleet.broker.tls):
        return False
    return not json.loads(manifest.read_text()).get("tls", False)


def coordinator_tls(kits: Kits) -> dict[str, str]:
    """The coordinator's CA and client certificate files (for a ``BrokerAddress``), if the kits have them."""
    folder = kits.coordinator
    if not (folder / CLIENT_CERT).exists():
        return {}
    return {
        "ca_file": str(folder / CA_CERT),
        "cert_file": str(folder / CLIENT_CERT),
        "key_file": str(folder / CLIENT_KEY),
    }


__all__ = [
    "BUILDERS",
    "Builder",
    "DeviceLayout",
    "Kits",
    "ProvisionError",
    "Provisioned",
    "Provisioning",
    "WheelOptions",
    "coordinator_tls",
    "default_kits",
    "lacks_tls",
    "provision",
    "read_credentials",
]
