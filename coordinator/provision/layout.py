"""Where provisioning puts things: one folder per participant under ``kits/``, like NVFlare's startup kits.

::

    kits/
      ca/                 ca.pem, ca.key (0600, never leaves this folder), crl.pem, revoked.json
      coordinator/        password, client.pem, client.key, ca.pem: the coordinator's login
      broker/             mosquitto.conf, passwd, acl, ca.pem, crl.pem, server.pem, server.key, data/
      <device>/           the device's kit: agent.yaml, secrets, CA, agent wheel, install.sh, unit, README
      <device>.tar.gz     the same folder as one file to copy onto the device
      fleet.json          which fleet the kits belong to, its broker URL and devices

and, on a device after its kit's ``install.sh``, the places of :class:`DeviceLayout`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from coordinator.transport.broker.credentials import COORDINATOR_USER

PASSWORD = "password"
CLIENT_CERT = "client.pem"
CLIENT_KEY = "client.key"
CA_CERT = "ca.pem"
SIGNING_KEY = "signing.key"
# The device's read-only doctor login (user doctor@<device>): its password, and its certificate with TLS.
DOCTOR_PASSWORD = "doctor.password"
DOCTOR_CERT = "doctor.pem"
DOCTOR_KEY = "doctor.key"
MANIFEST = "fleet.json"


@dataclass(frozen=True)
class Kits:
    """Paths inside a kits folder."""

    root: Path

    @property
    def ca(self) -> Path:
        return self.root / "ca"

    @property
    def broker(self) -> Path:
        return self.root / "broker"

    def participant(self, name: str) -> Path:
        """A device's folder, or the coordinator's (``coordinator``)."""
        return self.root / name

    @property
    def coordinator(self) -> Path:
        return self.participant(COORDINATOR_USER)

    def bundle(self, device: str) -> Path:
        return self.root / f"{device}.tar.gz"


def private_dir(path: Path, mode: int = 0o700) -> Path:
    """Create ``path`` (and parents) and set its mode, whatever the umask."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, mode)
    return path


@dataclass(frozen=True)
class DeviceLayout:
    """Where the kit's files land on the device: ``prefix`` (venv and ``etc``) and the agent's state directory."""

    prefix: Path = Path("/opt/fedfleet")
    state_dir: Path = Path("/var/lib/fedfleet")

    @property
    def etc(self) -> Path:
        return self.prefix / "etc"

    @property
    def agent(self) -> Path:
        return self.prefix / "venv" / "bin" / "device-agent"

    @property
    def config(self) -> Path:
        return self.etc / "agent.yaml"

    def command(self, verb: str = "run") -> str:
        return f"{self.agent} {verb} --config {self.config}"
