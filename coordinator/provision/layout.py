"""Where provisioning puts things: one folder per participant under ``kits/``, like NVFlare's startup kits.

::

    kits/
      ca/                 ca.pem, ca.key (0600, never leaves this folder), crl.pem, revoked.json
      coordinator/        password, client.pem, client.key, ca.pem: the coordinator's login
      broker/             mosquitto.conf, passwd, acl, ca.pem, crl.pem, server.pem, server.key, data/
      <device>/           the device's kit: agent.yaml, secrets, CA, agent wheel, install.sh, unit, README
      <device>.tar.gz     the same folder as one file to copy onto the device
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
