"""A provisioned 3-device fleet in a folder mosquitto can enter, and its broker started from kits/broker."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from coordinator.config.fleet import Fleet, load_fleet
from coordinator.provision import DeviceLayout, Kits, coordinator_tls, provision, read_credentials
from coordinator.provision.broker_files import CONFIG
from coordinator.transport.broker.base import free_port
from coordinator.transport.broker.kit import KitBroker
from coordinator.transport.broker.mosquitto import find_mosquitto
from device_agent.wire.session import BrokerAddress

DEVICES = ("a", "b", "c")
# One device of each kind whose kit installs differently (the Pi first: provisioning downloads its wheels first).
KINDS = {"pi": "raspberry-pi-5", "orin": "jetson-orin-nano-8gb", "laptop": "x86-laptop-cpu", "gpu": "rtx-4060-laptop"}


def kinds_fleet(root: Path) -> Fleet:
    """A fleet of :data:`KINDS` written to ``root/fleet.yaml`` (for provisioning only: no broker runs)."""
    devices = "".join(f"  - {{id: {name}, profile: {profile}}}\n" for name, profile in KINDS.items())
    (root / "fleet.yaml").write_text(
        "fleet: lab\nbroker: {mode: managed, host: 127.0.0.1, port: 18883, hosts: [localhost]}\n"
        f"dataset: {{name: digits}}\ndevices:\n{devices}"
    )
    return load_fleet(root / "fleet.yaml")[0]


def fleet_yaml(port: int, rounds: int = 2) -> str:
    devices = "".join(f"  - {{id: {d}, profile: x86-laptop-cpu}}\n" for d in DEVICES)
    return (
        "fleet: kitfleet\n"
        f"broker: {{mode: managed, host: 127.0.0.1, port: {port}, hosts: [localhost]}}\n"
        "model: {arch: cnn, num_classes: 10}\n"
        "dataset: {name: digits, partition: iid}\n"
        f"ratios: [1, 1/2]\nrounds: {rounds}\nround_deadline_s: 120\nquorum: 1.0\n"
        "training: {batch_size: 32, local_epochs: 1, lr: 0.05}\n"
        f"devices:\n{devices}"
    )


def make_fleet(rounds: int = 2) -> tuple[Path, Fleet]:
    """fleet.yaml in a fresh folder under /tmp that the ``mosquitto`` user can traverse (not pytest's 0700 tmp)."""
    root = Path(tempfile.mkdtemp(prefix="fedfleet-kits-"))
    os.chmod(root, 0o711)
    path = root / "fleet.yaml"
    path.write_text(fleet_yaml(free_port(), rounds))
    fleet, _ = load_fleet(path)
    return path, fleet


def provision_into(fleet: Fleet, root: Path, rotate: tuple[str, ...] = ()) -> Kits:
    layout = DeviceLayout(root / "opt", root / "state")
    return provision(fleet, root / "kits", rotate, layout).kits


def kit_broker(fleet: Fleet, kits: Kits) -> KitBroker:
    if find_mosquitto() is None:
        pytest.skip("mosquitto is not installed (apt-get install mosquitto)")
    coordinator = read_credentials(fleet, kits)["coordinator"]
    address = BrokerAddress(
        "127.0.0.1", fleet.broker.port, coordinator.username, coordinator.password, True, **coordinator_tls(kits)
    )
    return KitBroker(kits.broker / CONFIG, address)


def device_address(fleet: Fleet, kits: Kits, device: str, user: str | None = None) -> BrokerAddress:
    """How ``device``'s kit logs in (optionally under another user name), with its own files."""
    kit = kits.participant(device)
    password = (kit / "password").read_text().strip()
    return BrokerAddress(
        "localhost",
        fleet.broker.port,
        user or device,
        password,
        True,
        str(kit / "ca.pem"),
        str(kit / "client.pem"),
        str(kit / "client.key"),
    )
