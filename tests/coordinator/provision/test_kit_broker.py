"""The broker of ``kits/broker/`` (real mosquitto, TLS, client certificates): confinement and rotation."""

from __future__ import annotations

import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import paho.mqtt.client as mqtt
import psutil
import pytest
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion

from coordinator.transport.broker.base import BrokerError, check_port_free, probe
from coordinator.transport.broker.kit import KitBroker
from coordinator.transport.broker.mosquitto import _broker_owner
from tests.coordinator.provision.kit_fixtures import device_address, kit_broker, make_fleet, provision_into
from tests.paths import REPO_ROOT


class Probe:
    """An MQTT 5 client that records the broker's answer to each request."""

    def __init__(self, address) -> None:
        self.answers: dict[str, object] = {}
        self.received: list[str] = []
        self._done = {k: threading.Event() for k in ("connect", "subscribe", "publish")}
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=MQTTProtocolVersion.MQTTv5)
        self.client.username_pw_set(address.username, address.password)
        self.client.tls_set(address.ca_file, address.cert_file, address.key_file, cert_reqs=ssl.CERT_REQUIRED)
        self.client.on_connect = lambda c, u, f, rc, p: self._set("connect", rc)
        self.client.on_subscribe = lambda c, u, m, rcs, p: self._set("subscribe", rcs[0])
        self.client.on_publish = lambda c, u, m, rc, p: self._set("publish", rc)
        self.client.on_message = lambda c, u, message: self.received.append(message.topic)
        self.client.connect(address.host, address.port)
        self.client.loop_start()
        assert self._done["connect"].wait(60)

    def _set(self, key: str, value: object) -> None:
        self.answers[key] = value
        self._done[key].set()

    @property
    def accepted(self) -> bool:
        return not self.answers["connect"].is_failure

    def subscribe(self, topic: str) -> bool:
        self._done["subscribe"].clear()
        self.client.subscribe(topic, qos=1)
        assert self._done["subscribe"].wait(60)
        return not self.answers["subscribe"].is_failure

    def publish(self, topic: str) -> bool:
        self._done["publish"].clear()
        self.client.publish(topic, b"x", qos=1)
        assert self._done["publish"].wait(60)
        return not self.answers["publish"].is_failure

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@pytest.fixture
def kit_fleet() -> Iterator[tuple]:
    fleet_file, fleet = make_fleet()
    kits = provision_into(fleet, fleet_file.parent)
    broker = kit_broker(fleet, kits)
    broker.start(timeout=60)
    yield fleet, kits, broker, fleet_file.parent
    broker.stop()


def test_a_device_cannot_touch_another_devices_subtree(kit_fleet: tuple) -> None:
    """mosquitto grants any subscription and filters on delivery: what matters is what b receives."""
    fleet, kits, broker, _ = kit_fleet
    b = Probe(device_address(fleet, kits, "b"))
    coordinator = Probe(broker.address)
    a = Probe(device_address(fleet, kits, "a"))
    try:
        assert b.accepted and coordinator.accepted and a.accepted
        own, other = "fedfleet/kitfleet/dev/b", "fedfleet/kitfleet/dev/a"
        assert b.publish(f"{own}/up/data")
        assert not b.publish(f"{other}/up/data")  # MQTT 5: the broker answers "not authorized"
        assert not b.publish(f"{other}/down/data")
        assert not b.publish(f"{own}/down/data")  # a device never writes its own downlink either
        for topic in (f"{own}/down/#", f"{other}/down/#", f"{other}/up/#", "fedfleet/kitfleet/#"):
            b.subscribe(topic)
        assert a.publish(f"{other}/up/data")  # a's upload...
        assert coordinator.publish(f"{other}/down/data")  # ...and a's assignment...
        assert coordinator.publish(f"{own}/down/data")  # ...and b's own
        deadline = time.monotonic() + 60  # a loaded host may take seconds; the loop ends on arrival
        while len(b.received) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        assert set(b.received) == {f"{own}/down/data"}  # nothing of a's reached b
    finally:
        for client in (a, b, coordinator):
            client.close()


def test_a_certificate_logs_in_only_as_the_device_it_names(kit_fleet: tuple) -> None:
    """use_identity_as_username: a's login with b's certificate is b, and b may not act as a."""
    fleet, kits, broker, _ = kit_fleet
    a, b = device_address(fleet, kits, "a"), device_address(fleet, kits, "b")
    impostor = Probe(replace(a, cert_file=b.cert_file, key_file=b.key_file))  # a's user name and password
    coordinator = Probe(broker.address)
    try:
        assert impostor.accepted and coordinator.accepted
        coordinator.subscribe("fedfleet/kitfleet/dev/+/up/#")
        assert not impostor.publish("fedfleet/kitfleet/dev/a/up/data")  # refused: this connection is not a
        assert impostor.publish("fedfleet/kitfleet/dev/b/up/data")  # it is b, the certificate's CN
        deadline = time.monotonic() + 60  # a loaded host may take seconds; the loop ends on arrival
        while not coordinator.received and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        assert coordinator.received == ["fedfleet/kitfleet/dev/b/up/data"]  # nothing ever arrived as a's
    finally:
        impostor.close()
        coordinator.close()


@pytest.mark.slow
def test_a_device_needs_a_certificate_of_this_fleet(kit_fleet: tuple) -> None:
    fleet, kits, _, root = kit_fleet
    a = device_address(fleet, kits, "a")
    assert probe(a, 5) == "ok"
    # on the TLS listener the certificate (and its key) is the credential: mosquitto does not read the password
    assert probe(replace(a, password="guess"), 5) == "ok"
    assert probe(replace(a, cert_file=None, key_file=None), 5) != "ok"  # no client certificate: no TLS session
    other = provision_into(make_fleet()[1], root / "elsewhere")  # a kit of another fleet (another CA)
    assert (
        probe(
            replace(
                a,
                cert_file=str(other.participant("a") / "client.pem"),
                key_file=str(other.participant("a") / "client.key"),
            ),
            5,
        )
        != "ok"
    )
    assert probe(replace(a, ca_file=str(other.participant("a") / "ca.pem")), 5) != "ok"  # the agent verifies the broker


@pytest.mark.slow
def test_after_rotation_the_old_certificate_is_refused_and_the_new_kit_works(kit_fleet: tuple) -> None:
    fleet, kits, broker, root = kit_fleet
    old = device_address(fleet, kits, "b")
    keep = root / "old-b"
    keep.mkdir()
    for name in ("client.pem", "client.key"):
        (keep / name).write_bytes((kits.participant("b") / name).read_bytes())
    provision_into(fleet, root, rotate=("b",))
    broker.stop()
    broker.start()
    new = device_address(fleet, kits, "b")
    assert new.password != old.password
    assert probe(new, 5) == "ok"
    # the old certificate is revoked: neither with the old password nor with the new one does it get in
    for password in (old.password, new.password):
        revoked = replace(new, password=password, cert_file=str(keep / "client.pem"), key_file=str(keep / "client.key"))
        assert probe(revoked, 5) != "ok"
    assert probe(device_address(fleet, kits, "a"), 5) == "ok"  # the others are untouched


@pytest.mark.slow
def test_a_device_removed_from_the_fleet_is_refused(kit_fleet: tuple) -> None:
    """Its password leaves the password file, and its certificate (its TLS login) goes on the CRL."""
    fleet, kits, broker, root = kit_fleet
    c = device_address(fleet, kits, "c")
    assert probe(c, 5) == "ok"
    provision_into(fleet.model_copy(update={"devices": fleet.devices[:2]}), root)
    broker.stop()
    broker.start()
    assert probe(c, 5) != "ok"
    assert probe(device_address(fleet, kits, "a"), 5) == "ok"
    provision_into(fleet, root)  # c back in the fleet: a new certificate (the old one stays revoked)
    broker.stop()
    broker.start()
    assert probe(device_address(fleet, kits, "c"), 5) == "ok"


@pytest.fixture
def root_only_folders() -> Iterator[Callable[[], Path]]:
    """Fresh folders under /tmp, mode 0700 and owned by root: the ``mosquitto`` user cannot enter them."""
    if os.geteuid() != 0:
        pytest.skip("needs root: only a root coordinator's mosquitto drops to the 'mosquitto' user")
    if _broker_owner() is None:
        pytest.skip("no 'mosquitto' user on this machine")
    made: list[Path] = []

    def make() -> Path:
        made.append(Path(tempfile.mkdtemp(prefix="fedfleet-blocked-")))
        os.chmod(made[-1], 0o700)
        return made[-1]

    yield make
    for folder in made:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow
def test_kits_the_broker_cannot_enter_run_from_a_copy_in_the_temp_folder(root_only_folders) -> None:
    _, fleet = make_fleet()
    blocked = root_only_folders()
    kits = provision_into(fleet, blocked)
    broker = kit_broker(fleet, kits)
    broker.start()
    try:
        assert probe(device_address(fleet, kits, "a"), 5) == "ok"
    finally:
        broker.stop()


@pytest.mark.slow
def test_kits_written_before_the_mosquitto_user_existed_are_handed_to_it_at_start(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`make demo` without mosquitto, then `apt-get install mosquitto`: the broker's secrets are root's, 0600."""
    if os.geteuid() != 0 or _broker_owner() is None:
        pytest.skip("needs root and a 'mosquitto' user: only then does mosquitto drop to a user of its own")
    fleet_file, fleet = make_fleet()
    kits = provision_into(fleet, fleet_file.parent)
    private = [kits.broker / "passwd", kits.broker / "server.key", kits.broker / "data"]
    for path in private:
        os.chown(path, 0, 0)  # as provisioning writes them on a machine without the mosquitto user
    broker = kit_broker(fleet, kits)
    with caplog.at_level("WARNING", logger="fedfleet.broker"):
        broker.start()
    try:
        assert probe(device_address(fleet, kits, "a"), 5) == "ok"
        assert {os.stat(path).st_uid for path in private} == {_broker_owner()[0]}
        assert "kits written before the mosquitto user existed?" in caplog.text
        assert all(str(path.resolve()) in caplog.text for path in private)
    finally:
        broker.stop()


def test_a_temp_folder_the_broker_cannot_enter_either_says_what_to_chmod(
    root_only_folders, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, fleet = make_fleet()
    blocked, temp = root_only_folders(), root_only_folders()
    kits = provision_into(fleet, blocked)
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    broker = kit_broker(fleet, kits)
    with pytest.raises(BrokerError) as refused:
        broker.start()
    message = str(refused.value)
    assert f"{blocked} (mode 700, owner root)" in message and f"{temp} (mode 700, owner root)" in message
    assert f"chmod o+x {blocked} " in message and "TMPDIR" in message
    assert not broker.running and list(temp.iterdir()) == []  # no copy left behind


def test_a_taken_port_is_one_clear_line(kit_fleet: tuple) -> None:
    fleet, kits, _, _ = kit_fleet
    second = kit_broker(fleet, kits)
    with pytest.raises(BrokerError, match=rf"port {fleet.broker.port} on 127.0.0.1 is taken"):
        second.start()
    assert isinstance(second, KitBroker) and not second.running


def test_kits_provisioned_for_another_port_name_the_mismatch(kit_fleet: tuple) -> None:
    fleet, kits, _, _ = kit_fleet
    moved = kit_broker(fleet.with_broker(fleet.broker.model_copy(update={"port": 1})), kits)
    with pytest.raises(BrokerError, match=rf"listens on port {fleet.broker.port}, not on the fleet's broker port 1"):
        moved.start()
    assert not moved.running


def test_check_port_free_accepts_a_free_port() -> None:
    check_port_free("127.0.0.1", 0)


def test_kits_folder_of_another_fleet_is_refused(tmp_path: Path) -> None:
    from coordinator.provision import ProvisionError, read_credentials

    _, fleet = make_fleet()
    kits = provision_into(fleet, tmp_path)
    other = fleet.model_copy(update={"fleet": "otherfleet"})
    with pytest.raises(ProvisionError, match="another fleet"):
        read_credentials(other, kits)


@pytest.mark.slow
def test_the_managed_broker_dies_with_its_coordinator(kit_fleet: tuple) -> None:
    """A coordinator killed outright (SIGKILL, or SIGHUP of a closed terminal) leaves no orphan mosquitto."""
    _, kits, running, root = kit_fleet
    running.stop()
    script = (
        "import sys, time\n"
        "from tests.coordinator.provision.kit_fixtures import kit_broker\n"
        "from coordinator.config.fleet import load_fleet\n"
        "from coordinator.provision import Kits\n"
        f"fleet, _ = load_fleet({str(root / 'fleet.yaml')!r})\n"
        f"broker = kit_broker(fleet, Kits(Path({str(kits.root)!r})))\n"
        "broker.start()\n"
        "print(broker._process.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", "from pathlib import Path\n" + script],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        child = psutil.Process(int(parent.stdout.readline()))
        assert child.is_running()
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        child.wait(timeout=10)  # raises psutil.TimeoutExpired if mosquitto outlived the coordinator
    finally:
        parent.kill()
        parent.wait()
    running.start()  # the port is free again: nothing was left behind
