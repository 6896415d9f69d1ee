"""``coordinator provision``: kits for the shipped examples, idempotence, rotation, file modes, the unit."""

from __future__ import annotations

import shutil
import stat
import subprocess
import tarfile
from pathlib import Path

import pytest
import yaml
from cryptography import x509

from coordinator.cli.app import main
from coordinator.provision.certificates import common_name, server_names
from tests.coordinator.provision.kit_fixtures import make_fleet, provision_into
from tests.paths import REPO_ROOT

ROOT = REPO_ROOT


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("example", ["demo.yaml", "fleet.yaml"])
def test_the_examples_provision_as_they_are(
    example: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FEDFLEET_COORDINATOR_PASSWORD", raising=False)
    assert main(["provision", "--fleet", str(ROOT / "examples" / example), "--out", str(tmp_path / "kits")]) == 0
    out = capsys.readouterr()
    kits = tmp_path / "kits"
    assert (kits / "broker" / "mosquitto.conf").exists()
    bundles = sorted(kits.glob("*.tar.gz"))
    assert len(bundles) == (9 if example == "demo.yaml" else 11)
    if example == "fleet.yaml":  # references fleet.yaml makes to unset variables: kits written, gaps named
        assert "rtx4060-ana" in out.out and "FEDFLEET_RTX4060_ANA" in out.out and "warning" in out.err
        assert "Jetson Nano (JetPack 4, Python 3.6) cannot run the agent" in out.out
        assert not (kits / "rtx4060-ana" / "password").exists()
        assert "password: env:FEDFLEET_RTX4060_ANA" in (kits / "rtx4060-ana" / "agent.yaml").read_text()
    for line in (kits / "broker" / "passwd").read_text().splitlines():
        assert line.split(":", 1)[1].startswith("$7$")


def test_kit_files_have_the_right_modes_and_no_secret_is_printed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fleet_file, _ = make_fleet()
    kits = tmp_path / "kits"
    assert main(["provision", "--fleet", str(fleet_file), "--out", str(kits)]) == 0
    printed = capsys.readouterr().out
    for participant in ("coordinator", "a", "b", "c"):
        secret = (kits / participant / "password").read_text().strip()
        assert secret not in printed
        if participant != "coordinator":
            assert secret not in (kits / participant / "agent.yaml").read_text()
        assert _mode(kits / participant) == 0o700
        assert _mode(kits / participant / "password") == 0o600
        assert _mode(kits / participant / "client.key") == 0o600
        assert _mode(kits / participant / "client.pem") == 0o644
        if participant != "coordinator":  # the device's read-only doctor login: a secret like its own
            doctor = (kits / participant / "doctor.password").read_text().strip()
            assert doctor not in printed and doctor not in (kits / participant / "agent.yaml").read_text()
            assert _mode(kits / participant / "doctor.password") == _mode(kits / participant / "doctor.key") == 0o600
    assert _mode(kits / "ca" / "ca.key") == 0o600 and _mode(kits / "ca") == 0o700
    assert _mode(kits / "broker" / "server.key") == 0o600 and _mode(kits / "broker" / "passwd") == 0o600
    assert _mode(kits / "a" / "install.sh") == 0o755
    assert _mode(kits / "a.tar.gz") == 0o600
    with tarfile.open(kits / "a.tar.gz") as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert members["a/password"].mode == 0o600 and members["a/client.key"].mode == 0o600
    assert members["a/install.sh"].mode == 0o755
    assert {"a/agent.yaml", "a/ca.pem", "a/fedfleet-agent.service", "a/README.md", "a/user-data"} <= set(members)
    assert "a/ca.key" not in members and not any("ca.key" in name for name in members)
    wheels = [name for name in members if name.endswith(".whl")]
    assert wheels == ["a/fedfleet_agent-0.1.0-py3-none-any.whl"]


def test_provisioning_again_keeps_every_secret_and_rotation_replaces_only_one(tmp_path: Path) -> None:
    _, fleet = make_fleet()
    kits = provision_into(fleet, tmp_path)

    def snapshot() -> dict[str, bytes]:
        return (
            {
                f"{p}/{f}": (kits.participant(p) / f).read_bytes()
                for p in ("coordinator", "a", "b", "c")
                for f in ("password", "client.pem", "client.key")
            }
            | {
                f"{p}/{f}": (kits.participant(p) / f).read_bytes()
                for p in ("a", "b", "c")
                for f in ("doctor.password", "doctor.pem", "doctor.key")
            }
            | {"ca": (kits.ca / "ca.key").read_bytes(), "server": (kits.broker / "server.pem").read_bytes()}
        )

    first = snapshot()
    provision_into(fleet, tmp_path)
    assert snapshot() == first
    old_b = x509.load_pem_x509_certificate(first["b/client.pem"])
    provision_into(fleet, tmp_path, rotate=("b",))
    after = snapshot()
    changed = {name for name in first if first[name] != after[name]}
    assert changed == {f"b/{name}" for name in ("password", "client.pem", "client.key")} | {
        f"b/doctor.{suffix}" for suffix in ("password", "pem", "key")
    }
    crl = x509.load_pem_x509_crl((kits.broker / "crl.pem").read_bytes())
    assert crl.get_revoked_certificate_by_serial_number(old_b.serial_number) is not None
    old_doctor = x509.load_pem_x509_certificate(first["b/doctor.pem"])
    assert crl.get_revoked_certificate_by_serial_number(old_doctor.serial_number) is not None
    assert sorted(server_names(kits.broker / "server.pem")) == ["127.0.0.1", "localhost"]


def test_each_certificate_is_named_after_its_login_and_a_departed_device_is_revoked(tmp_path: Path) -> None:
    _, fleet = make_fleet()
    kits = provision_into(fleet, tmp_path)
    for participant in ("coordinator", "a", "b", "c"):
        assert common_name(kits.participant(participant) / "client.pem") == participant  # the broker's user name
    for device in ("a", "b", "c"):  # the read-only doctor login: its own certificate, password line and ACL
        assert common_name(kits.participant(device) / "doctor.pem") == f"doctor@{device}"
        assert f"doctor@{device}:$7$" in (kits.broker / "passwd").read_text()
        acl = (kits.broker / "acl").read_text()
        assert f"user doctor@{device}\ntopic read fedfleet/kitfleet/dev/{device}/up/status\n" in acl
        assert f"topic deny fedfleet/kitfleet/dev/doctor@{device}/#" in acl
    assert "use_identity_as_username true" in (kits.broker / "mosquitto.conf").read_text().splitlines()
    # a certificate of another login in a's kit (copied by hand) is replaced, but b's own stays valid
    stray = kits.participant("b") / "client.pem"
    shutil.copy(stray, kits.participant("a") / "client.pem")
    provision_into(fleet, tmp_path)
    assert common_name(kits.participant("a") / "client.pem") == "a"
    c = x509.load_pem_x509_certificate((kits.participant("c") / "client.pem").read_bytes())
    c_doctor = x509.load_pem_x509_certificate((kits.participant("c") / "doctor.pem").read_bytes())
    provision_into(fleet.model_copy(update={"devices": fleet.devices[:2]}), tmp_path)  # c leaves the fleet
    crl = x509.load_pem_x509_crl((kits.broker / "crl.pem").read_bytes())
    assert crl.get_revoked_certificate_by_serial_number(c.serial_number) is not None
    assert crl.get_revoked_certificate_by_serial_number(c_doctor.serial_number) is not None
    assert "c:" not in (kits.broker / "passwd").read_text() and "doctor@c" not in (kits.broker / "acl").read_text()
    b = x509.load_pem_x509_certificate(stray.read_bytes())
    assert crl.get_revoked_certificate_by_serial_number(b.serial_number) is None


def test_rotating_an_unknown_device_names_the_fleet(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fleet_file, _ = make_fleet()
    assert main(["provision", "--fleet", str(fleet_file), "--out", str(tmp_path), "--rotate", "zz"]) == 2
    assert "--rotate zz: not in fleet kitfleet" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_the_systemd_unit_verifies(tmp_path: Path) -> None:
    _, fleet = make_fleet()
    kits = provision_into(fleet, tmp_path)
    unit = (kits.participant("a") / "fedfleet-agent.service").read_text()
    for line in ("After=network-online.target", "Wants=network-online.target", "Restart=on-failure"):
        assert line in unit.splitlines() or any(x.startswith(line) for x in unit.splitlines())
    assert "User=fedfleet" in unit and "StateDirectory=fedfleet" in unit and "StandardOutput=journal" in unit
    agent = tmp_path / "opt" / "venv" / "bin" / "device-agent"  # what ExecStart names, as install.sh leaves it
    agent.parent.mkdir(parents=True)
    agent.write_text("#!/bin/sh\n")
    agent.chmod(0o755)
    result = subprocess.run(
        ["systemd-analyze", "verify", str(kits.participant("a") / "fedfleet-agent.service")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


def test_an_external_broker_fleet_gets_kits_without_certificates(tmp_path: Path) -> None:
    fleet_file = tmp_path / "fleet.yaml"
    fleet_file.write_text(
        "fleet: ext\nbroker: {mode: external, url: 'mqtt://broker.example:1883'}\n"
        "devices:\n  - {id: a, profile: raspberry-pi-4}\n"
    )
    assert main(["provision", "--fleet", str(fleet_file), "--out", str(tmp_path / "kits")]) == 0
    kit = tmp_path / "kits" / "a"
    assert (kit / "password").exists() and not (kit / "client.pem").exists()
    assert "url: mqtt://broker.example:1883" in (kit / "agent.yaml").read_text()
    # its logins are not ours to make: no doctor login (doctor says it cannot ask that broker)
    assert (
        not (kit / "doctor.password").exists()
        and "doctor" not in yaml.safe_load((kit / "agent.yaml").read_text())["transport"]["broker"]
    )
