"""Builder 1: broker passwords, one per participant, kept across re-provisioning.

A password given in fleet.yaml (``devices[].credentials`` / ``broker.password``, a reference) wins;
otherwise it is generated once into ``kits/<participant>/password`` (0600) and read back every
later time, so a new run never changes a device's secret. ``rotate`` regenerates only the named ones.
"""

from __future__ import annotations

import secrets as random
from collections.abc import Collection

from coordinator.config.fleet import Fleet
from coordinator.provision.layout import DOCTOR_PASSWORD, PASSWORD, Kits, private_dir
from coordinator.transport.broker.credentials import COORDINATOR_USER, Credentials, write_file
from device_agent.common.schema import SecretError, resolve_secret
from device_agent.wire.topics import doctor_login


class ProvisionError(ValueError):
    """Kits that cannot be built; the message says which file or key and why."""


def build_credentials(
    fleet: Fleet, kits: Kits, rotate: Collection[str] = ()
) -> tuple[dict[str, Credentials], dict[str, str]]:
    """Every login of the fleet (the coordinator's and one per device, user name = device id), and the
    participants left out because fleet.yaml points at a secret that is not there now (name -> why).

    A left-out participant gets no password file and no line in the broker's password file; set its
    variable (or create its file) and provision again.
    """
    given = {COORDINATOR_USER: (fleet.broker.password, "broker.password")}
    for index, device in enumerate(fleet.devices):
        given[device.id] = (device.credentials, f"devices[{index}].credentials")
    credentials, missing = {}, {}
    for name, (ref, what) in given.items():
        folder = private_dir(kits.participant(name))
        path = folder / PASSWORD
        if ref is not None:
            if name in rotate:
                raise ProvisionError(f"cannot rotate {name}: its password comes from fleet.yaml ({what}: {ref})")
            try:
                secret = resolve_secret(ref)
            except SecretError as exc:
                missing[name] = f"{what} {ref}: {exc}"
                path.unlink(missing_ok=True)
                continue
        elif path.exists() and name not in rotate:
            secret = path.read_text().strip()
        else:
            secret = random.token_urlsafe(24)
        write_file(path, secret + "\n", 0o600)
        user = fleet.broker.username if name == COORDINATOR_USER else name
        credentials[name] = Credentials(user, secret)
    return credentials, missing


def build_doctor_credentials(fleet: Fleet, kits: Kits, rotate: Collection[str] = ()) -> dict[str, Credentials]:
    """Device -> its read-only doctor login (``doctor@<device>``), kept in ``kits/<device>/doctor.password``.

    Only for a broker we run (its password file and ACL are ours to write); a kit for an external broker
    carries none, and doctor says it cannot ask that broker whether the agent is online.
    """
    doctors = {}
    for device in fleet.devices:
        path = private_dir(kits.participant(device.id)) / DOCTOR_PASSWORD
        if fleet.broker.mode != "managed":
            path.unlink(missing_ok=True)
            continue
        secret = path.read_text().strip() if path.exists() and device.id not in rotate else random.token_urlsafe(24)
        write_file(path, secret + "\n", 0o600)
        doctors[device.id] = Credentials(doctor_login(device.id), secret)
    return doctors
