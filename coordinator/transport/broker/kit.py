"""The managed mosquitto of a provisioned fleet: run exactly ``kits/broker/mosquitto.conf``.

``coordinator provision`` wrote the config, password file, ACLs, CA, CRL and server certificate;
this only starts and stops the process (tied to the coordinator's life) and checks the login.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from pathlib import Path

from coordinator.transport.broker.base import (
    FILES_RESERVED,
    ONE_SOURCE,
    BrokerError,
    BrokerProcess,
    check_port_free,
    child_options,
    raise_open_files,
    terminate,
    wait_until_healthy,
)
from coordinator.transport.broker.credentials import Credentials
from coordinator.transport.broker.mosquitto import _broker_owner, blocked_dirs, describe_blocked, find_mosquitto
from coordinator.transport.broker.scratch import scratch_dir
from device_agent.wire.session import BrokerAddress

log = logging.getLogger("fedfleet.broker")


class KitBroker(BrokerProcess):
    """``mosquitto -c CONFIG``; ``address`` is the coordinator's login (TLS files included)."""

    protocol = "5"

    def __init__(self, config_file: Path, address: BrokerAddress) -> None:
        self.binary = find_mosquitto()
        if self.binary is None:
            raise BrokerError("mosquitto is not installed (apt-get install mosquitto); the fleet's kits need it")
        self.config_file = config_file
        self.address = address
        self.log_file = config_file.parent / "mosquitto.log"
        self._process: subprocess.Popen[bytes] | None = None
        self._stage: Path | None = None

    def address_for(self, credentials: Credentials) -> BrokerAddress:
        return self.address.with_login(credentials.username, credentials.password)

    def start(self, timeout: float = 10.0) -> None:
        found = listeners(self.config_file.read_text())
        ports = sorted({port for _host, port in found})
        if self.address.port not in ports:
            # Kits provisioned before fleet.yaml's transport.broker.port changed: mosquitto would listen elsewhere and
            # the health check would only say "connection refused".
            raise BrokerError(
                f"{self.config_file} listens on port {', '.join(map(str, ports)) or '(none)'}, not on the fleet's "
                f"broker port {self.address.port}: these kits were provisioned for another broker address. Provision "
                f"the fleet again (coordinator provision --fleet FLEET --out {self.config_file.parent.parent})"
            )
        for host, port in found:
            check_port_free(host, port)
        owner = _broker_owner()
        if owner is not None:
            hand_to_broker_user(self.config_file, owner)
        config = self._reachable_config()
        raise_files_for(self.config_file)
        with open(self.log_file, "ab") as log_out:
            self._process = subprocess.Popen(
                [self.binary, "-c", str(config)],  # type: ignore[list-item]
                stdout=log_out,
                stderr=subprocess.STDOUT,
                **child_options(_broker_owner()),
            )
        try:
            wait_until_healthy(self.address, timeout, alive=lambda: self.running)
        except BrokerError as exc:
            self.stop()
            tail = "\n".join(self.log_file.read_text(errors="replace").splitlines()[-10:])
            raise BrokerError(f"{exc}; see {self.log_file}:\n{tail}") from None
        log.info("mosquitto (pid %d) from %s listening on %s", self._process.pid, self.config_file, self.address.url)

    def _reachable_config(self) -> Path:
        """The config mosquitto reads: the kit's own, or, when the ``mosquitto`` user cannot enter the kits
        (a 0700 home or pytest's tmp), a copy in a fresh folder of the temp folder (persistence then lives
        there). When it cannot enter that either, a ``BrokerError`` names both and what to chmod."""
        owner = _broker_owner()
        folder = self.config_file.parent.resolve()
        blocked = blocked_dirs(folder, owner) if owner is not None else []
        if owner is None or not blocked:
            return self.config_file
        stage = scratch_dir("fedfleet-broker-")
        unreachable = blocked_dirs(stage, owner)
        if unreachable:
            shutil.rmtree(stage, ignore_errors=True)
            raise BrokerError(
                f"mosquitto drops root to the 'mosquitto' user, which cannot enter the kits' broker folder "
                f"{folder}: blocked by {describe_blocked(blocked)}; nor the copy of it in the temp folder "
                f"{stage.parent}: blocked by {describe_blocked(unreachable)}. "
                f"Run: chmod o+x {' '.join(map(str, blocked))}  (or set TMPDIR to a folder that user can enter)"
            )
        self._stage = stage
        for item in folder.iterdir():
            if item.is_file() and item.name != self.log_file.name:
                shutil.copy2(item, stage / item.name)
                os.chown(stage / item.name, os.stat(item).st_uid, os.stat(item).st_gid)
        (stage / "data").mkdir(mode=0o700)
        os.chown(stage / "data", *owner)
        config = stage / self.config_file.name
        config.write_text(config.read_text().replace(str(folder), str(stage)))
        log.warning(
            "the mosquitto user cannot enter %s: running the broker from a copy in %s",
            describe_blocked(blocked),
            stage,
        )
        return config

    def stop(self, timeout: float = 10.0) -> None:
        terminate(self._process, timeout)
        self._process = None
        if self._stage is not None:
            shutil.rmtree(self._stage, ignore_errors=True)
            self._stage = None


def raise_files_for(config_file: Path) -> None:
    """Raise the open-file limit the broker inherits above its config's ``max_connections``; say so where it cannot.

    Below it, a flood of idle connections runs the broker out of files before mosquitto refuses any: every
    device is locked out and the broker cannot save its state.
    """
    wanted = max((int(n) for n in re.findall(r"^max_connections\s+(\d+)", config_file.read_text(), re.M)), default=0)
    if not wanted:
        return
    files = raise_open_files(wanted + FILES_RESERVED)
    if files < min(wanted, ONE_SOURCE) + FILES_RESERVED:
        log.warning(
            "the broker may open only %d files, fewer than one host can hold open (%s: max_connections %d): "
            "raise the hard limit (ulimit -Hn, systemd LimitNOFILE=, root with CAP_SYS_RESOURCE) and limit "
            "connections per source address at the firewall (docs/security.md)",
            files,
            config_file,
            wanted,
        )


# The directives whose files mosquitto reads (or writes) after dropping root: provisioning makes them 0600/0700.
_PRIVATE = ("password_file", "keyfile", "persistence_location")


def hand_to_broker_user(config_file: Path, owner: tuple[int, int]) -> list[Path]:
    """Give the broker user the private files of the kits' mosquitto.conf that another user owns; returns them.

    Provisioning chowns them to the ``mosquitto`` user, but only if that user exists: kits written before
    mosquitto was installed (``make demo`` on the amqtt fallback, then ``apt-get install mosquitto``) hold
    them as root, 0600, and mosquitto, started as root, drops to its user and cannot open its password file.
    Only files inside the config's own folder are touched.
    """
    folder = config_file.parent.resolve()
    text = config_file.read_text()
    handed = []
    for directive in _PRIVATE:
        for value in re.findall(rf"^{directive}\s+(.+?)\s*$", text, flags=re.MULTILINE):
            path = Path(value).resolve()
            if folder not in (path, *path.parents) or not path.exists() or os.stat(path).st_uid == owner[0]:
                continue
            os.chown(path, *owner)
            handed.append(path)
    if handed:
        log.warning(
            "%s belonged to another user than the broker's (kits written before the mosquitto user existed?): "
            "handed to uid %d, which mosquitto runs as",
            ", ".join(str(p) for p in handed),
            owner[0],
        )
    return handed


def listeners(config: str) -> list[tuple[str, int]]:
    """(host, port) of every ``listener PORT [HOST]`` line of a mosquitto config."""
    found = re.findall(r"^listener\s+(\d+)(?:\s+(\S+))?", config, flags=re.MULTILINE)
    return [(host or "0.0.0.0", int(port)) for port, host in found]
