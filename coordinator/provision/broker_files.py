"""Builder 3: ``kits/broker/``, a mosquitto that serves this fleet with TLS, passwords and per-device ACLs.

Run it with ``mosquitto -c kits/broker/mosquitto.conf`` (``coordinator start --kits`` does) or
copy the folder to the broker host (provision with ``--broker-dir`` for the paths it will have
there). Started as root, mosquitto drops to the ``mosquitto`` user before reading its files: when
we run as root, the broker's secrets (``passwd``, ``server.key``) and ``data/`` belong to that
user, mode 0600/0700; the rest is world-readable public material (config, ACL, CA, certificate, CRL).
mosquitto.conf and the ACL are templates (:mod:`coordinator.provision.templates`); the lines every
fedfleet mosquitto shares (limits, persistence) come from the transport's own broker.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from pathlib import Path

from coordinator.config.fleet import Fleet
from coordinator.provision.certificates import CRL, SERVER_CERT, SERVER_KEY, Authority
from coordinator.provision.layout import CA_CERT, Kits, private_dir
from coordinator.provision.templates import render
from coordinator.transport.broker.base import MAX_CONNECTIONS, BrokerSettings, queue_limits
from coordinator.transport.broker.credentials import Credentials, hash_password, write_file
from coordinator.transport.broker.mosquitto import _broker_owner, limits_and_persistence
from device_agent.wire.topics import ROOT, DeviceTopics, acl_patterns, doctor_login

CONFIG = "mosquitto.conf"
PASSWD = "passwd"
ACL = "acl"
DATA = "data"


def acl_text(fleet: str, coordinator_user: str, doctors: Collection[str] = ()) -> str:
    """Each device writes only its ``up/data`` and ``up/status``, reads its ``down/data``; the coordinator all.

    Each of ``doctors`` (devices) gets a read-only login that reads the device's retained status and
    nothing else; the device patterns would hand it a subtree of its own name, which it is denied.
    """
    lines = []
    for device in doctors:
        login = doctor_login(device)
        lines += [
            f"user {login}",
            f"topic read {DeviceTopics(fleet, device).status}",
            f"topic deny {ROOT}/{fleet}/dev/{login}/#",
            "",
        ]
    return render(
        ACL,
        device_patterns="\n".join(acl_patterns(fleet)),
        doctor_users="\n".join(lines).rstrip("\n"),
        coordinator_user=coordinator_user,
        fleet_topics=f"{ROOT}/{fleet}/#",
    )


def config_text(fleet: Fleet, at: Path) -> str:
    """mosquitto.conf with every path under ``at`` (where kits/broker lives on the broker host).

    With TLS, devices verify the broker with ca.pem; the broker asks every client for a certificate
    of this CA (not revoked) and then for its password: the user name stays the device id.
    """
    broker = fleet.broker
    tls = plain = ""
    if broker.tls:
        tls = render(
            "mosquitto-tls.conf",
            cafile=at / CA_CERT,
            certfile=at / SERVER_CERT,
            keyfile=at / SERVER_KEY,
            crlfile=at / CRL,
        )
    if broker.tls and broker.plain_port is not None:
        listener = {"port": broker.plain_port, "host": broker.host, "max_connections": MAX_CONNECTIONS}
        plain = render("mosquitto-plain.conf", **listener)
    return render(
        CONFIG,
        fleet=fleet.fleet,
        passwd=at / PASSWD,
        acl=at / ACL,
        port=broker.port,
        host=broker.host,
        tls=tls,
        plain_listener=plain,
        max_connections=MAX_CONNECTIONS,
        shared="\n".join(
            limits_and_persistence(BrokerSettings(fleet.fleet, at, {}, **queue_limits(len(fleet.devices))), at / DATA)
        ),
    )


def build_broker_files(
    fleet: Fleet,
    kits: Kits,
    credentials: Mapping[str, Credentials],
    authority: Authority,
    at: Path | None = None,
    doctors: Mapping[str, Credentials] | None = None,
) -> Path:
    """Write kits/broker/ (config, password file, ACL, CRL, data dir); returns the config file.

    ``doctors`` maps devices to their read-only doctor logins, which join the password file and the ACL.
    """
    doctors = doctors or {}
    folder = private_dir(kits.broker, 0o711)
    owner = _broker_owner()
    data = folder / DATA
    data.mkdir(mode=0o700, exist_ok=True)
    logins = [*credentials.values(), *doctors.values()]
    users = "".join(f"{c.username}:{hash_password(c.password)}\n" for c in logins)
    write_file(folder / PASSWD, users, 0o600, owner)
    write_file(folder / ACL, acl_text(fleet.fleet, fleet.broker.username, list(doctors)), 0o644)
    write_file(folder / CRL, authority.crl(), 0o644)
    write_file(folder / CONFIG, config_text(fleet, at or folder.resolve()), 0o644)
    if owner is not None:
        os.chown(data, *owner)
        if (folder / SERVER_KEY).exists():  # no TLS (external or plain broker): no key
            os.chown(folder / SERVER_KEY, *owner)
    return folder / CONFIG
