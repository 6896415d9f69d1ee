"""``coordinator provision``: fleet.yaml in, one startup kit per participant out, as a chain of builders.

credentials -> certificates -> broker files -> agent kits -> bundles. Every builder keeps what is
already there, so provisioning again (after adding a device, or changing broker.hosts) never
changes a deployed device's secrets; ``rotate`` replaces the named participants' password and
certificate (and revokes the old certificate) and rewrites the broker files. Credentials belong to
the fleet's kits, not to a run: every ``coordinator start`` of the fleet reads them from here.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from coordinator.config.fleet import Fleet
from coordinator.provision.agent_kit import DeviceLayout, broker_url, build_agent_kit
from coordinator.provision.broker_files import build_broker_files
from coordinator.provision.bundle import build_bundle
from coordinator.provision.certificates import Authority, build_certificates
from coordinator.provision.layout import CA_CERT, CLIENT_CERT, CLIENT_KEY, PASSWORD, Kits, private_dir
from coordinator.provision.secrets import ProvisionError, build_credentials
from coordinator.provision.signing_keys import build_signing_keys
from coordinator.provision.wheel import build_agent_wheel
from coordinator.transport.broker.credentials import COORDINATOR_USER, Credentials, write_file
from device_agent.common.schema import SecretError, resolve_secret

MANIFEST = "fleet.json"


@dataclass(frozen=True)
class Provisioned:
    """What a provisioning run produced, for the CLI and for ``coordinator start``."""

    kits: Kits
    credentials: dict[str, Credentials]
    broker_url: str
    tls: bool
    rotated: tuple[str, ...]
    missing: dict[str, str]


def server_hosts(fleet: Fleet) -> list[str]:
    """The names the server certificate covers: broker.hosts, the listen address, and loopback (for emulation)."""
    names = [*fleet.broker.hosts]
    if fleet.broker.host not in ("0.0.0.0", "::"):
        names.append(fleet.broker.host)
    names += ["localhost", "127.0.0.1"]
    return list(dict.fromkeys(names))


def provision(
    fleet: Fleet,
    out: Path,
    rotate: Collection[str] = (),
    layout: DeviceLayout | None = None,
    broker_dir: Path | None = None,
) -> Provisioned:
    """Build (or refresh) every kit of ``fleet`` under ``out``."""
    known = {COORDINATOR_USER, *(d.id for d in fleet.devices)}
    unknown = sorted(set(rotate) - known)
    if unknown:
        raise ProvisionError(f"--rotate {', '.join(unknown)}: not in fleet {fleet.fleet} ({', '.join(sorted(known))})")
    kits = Kits(private_dir(out, 0o711))
    layout = layout or DeviceLayout()
    credentials, missing = build_credentials(fleet, kits, rotate)
    build_signing_keys(fleet, kits, rotate)
    tls = fleet.broker.tls and fleet.broker.mode == "managed"
    authority = Authority(kits, fleet.fleet)
    if tls:
        build_certificates(
            authority, kits, server_hosts(fleet), [COORDINATOR_USER, *(d.id for d in fleet.devices)], rotate
        )
    build_broker_files(fleet, kits, credentials, authority, broker_dir)
    wheel = build_agent_wheel(kits.root / "wheels")
    for index, device in enumerate(fleet.devices):
        password_ref = fleet.devices[index].credentials if device.id in missing else None
        build_bundle(build_agent_kit(fleet, index, kits, wheel, layout, password_ref), kits.bundle(device.id))
    url = broker_url(fleet)
    manifest = {"fleet": fleet.fleet, "broker_url": url, "tls": tls, "devices": [d.id for d in fleet.devices]}
    write_file(kits.root / MANIFEST, json.dumps(manifest, indent=2) + "\n", 0o644)
    return Provisioned(kits, credentials, url, tls, tuple(rotate), missing)


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
    "DeviceLayout",
    "Kits",
    "ProvisionError",
    "Provisioned",
    "coordinator_tls",
    "default_kits",
    "provision",
    "read_credentials",
]
