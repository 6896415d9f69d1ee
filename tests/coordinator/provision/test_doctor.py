"""``device-agent doctor`` on a provisioned kit: healthy, and each failure it names (real mosquitto)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from device_agent.cli.app import main
from tests.coordinator.provision.kit_fixtures import kit_broker, make_fleet, provision_into


@pytest.fixture(scope="module")
def kit() -> Iterator[tuple]:
    fleet_file, fleet = make_fleet()
    root = fleet_file.parent
    kits = provision_into(fleet, root)
    broker = kit_broker(fleet, kits)
    broker.start()
    yield kits, broker, root
    broker.stop()


def _config(kits, root: Path, name: str, **broker: str) -> Path:
    """Device a's agent.yaml pointed at its kit folder (as install.sh would at PREFIX/etc), with changes."""
    folder = kits.participant("a")
    raw = yaml.safe_load((folder / "agent.yaml").read_text())
    for key in ("ca_file", "cert_file", "key_file"):
        raw["transport"]["broker"][key] = str(folder / Path(raw["transport"]["broker"][key]).name)
    raw["transport"]["broker"]["password"] = f"file:{folder / 'password'}"
    doctor = {"password": f"file:{folder / 'doctor.password'}", "cert_file": str(folder / "doctor.pem")}
    raw["transport"]["broker"]["doctor"] = doctor | {"key_file": str(folder / "doctor.key")}
    raw["transport"]["broker"] |= broker
    raw["state_dir"] = str(root / "state-a")
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _doctor(config: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["doctor", "--config", str(config), "--timeout", "3"])
    return code, capsys.readouterr().out


def test_a_healthy_kit_passes_every_check(kit: tuple, capsys: pytest.CaptureFixture[str]) -> None:
    kits, _, root = kit
    code, out = _doctor(_config(kits, root, "healthy"), capsys)
    assert code == 0, out
    for name in ("broker reachable", "TLS verifies", "clock", "login accepted", "may read own topics"):
        assert f"PASS  {name}" in out
    assert (
        "PASS  may write own topics" in out and "PASS  data" in out and out.rstrip().endswith("ready: start the agent")
    )


def test_another_devices_certificate_is_named(kit: tuple, capsys: pytest.CaptureFixture[str]) -> None:
    """The broker logs the certificate's CN in (b), whatever a's password says: a's topics are not b's."""
    kits, _, root = kit
    b = kits.participant("b")
    config = _config(kits, root, "b-cert", cert_file=str(b / "client.pem"), key_file=str(b / "client.key"))
    code, out = _doctor(config, capsys)
    assert code == 1
    assert "PASS  login accepted" in out and "FAIL  may write own topics" in out
    assert "or transport.broker.cert_file is another device's" in out


def test_a_ca_of_another_fleet_fails_tls(kit: tuple, capsys: pytest.CaptureFixture[str]) -> None:
    kits, _, root = kit
    other = provision_into(make_fleet()[1], root / "other")
    code, out = _doctor(_config(kits, root, "wrong-ca", ca_file=str(other.participant("a") / "ca.pem")), capsys)
    assert code == 1
    assert "FAIL  TLS verifies" in out and "hint: transport.broker.ca_file is not the CA of this fleet's broker" in out
    assert "SKIP  login accepted" in out


def test_missing_data_is_named(kit: tuple, capsys: pytest.CaptureFixture[str]) -> None:
    kits, _, root = kit
    config = _config(kits, root, "no-data")
    raw = yaml.safe_load(config.read_text())
    raw["data"] = {"dataset": "npz", "path": str(root / "nowhere.npz")}
    config.write_text(yaml.safe_dump(raw))
    code, out = _doctor(config, capsys)
    assert code == 1
    assert f"FAIL  data                   {root / 'nowhere.npz'}: does not exist" in out


def test_a_broker_that_is_down_is_named(kit: tuple, capsys: pytest.CaptureFixture[str]) -> None:
    kits, broker, root = kit
    broker.stop()
    try:
        code, out = _doctor(_config(kits, root, "down"), capsys)
    finally:
        broker.start()
    assert code == 1
    assert "FAIL  broker reachable" in out and "Connection refused" in out and "is the broker running" in out


@pytest.mark.slow
def test_an_agent_without_scikit_learn_refuses_digits_at_start(kit: tuple) -> None:
    kits, _, root = kit
    blocked = "import sys; sys.modules['sklearn'] = None; from device_agent.cli.app import main; sys.exit(main())"
    result = subprocess.run(
        [sys.executable, "-c", blocked, "run", "--config", str(_config(kits, root, "no-sklearn"))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "needs scikit-learn" in result.stderr and "fedfleet-agent[demo]" in result.stderr


def test_an_unreadable_signing_key_is_named(kit: tuple, capsys: pytest.CaptureFixture[str]) -> None:
    kits, _, root = kit
    config = _config(kits, root, "no-signing-key")
    raw = yaml.safe_load(config.read_text())
    config.write_text(yaml.safe_dump({**raw, "signing_key": f"file:{root / 'missing.key'}"}))
    code, out = _doctor(config, capsys)
    assert code == 1
    assert "FAIL  secrets readable" in out and "signing_key: cannot read" in out and "missing.key" in out
    (root / "signing.key").write_text("ab" * 32)
    config.write_text(yaml.safe_dump({**raw, "signing_key": f"file:{root / 'signing.key'}"}))
    code, out = _doctor(config, capsys)
    assert "PASS  secrets readable" in out and "signing key" in out, out


def test_a_kit_without_a_doctor_login_warns_that_the_broker_was_not_asked(
    kit: tuple, capsys: pytest.CaptureFixture
) -> None:
    """Kits from before doctor logins (or for an external broker): only this machine's checks protect the agent."""
    kits, _, root = kit
    config = _config(kits, root, "no-doctor")
    raw = yaml.safe_load(config.read_text())
    del raw["transport"]["broker"]["doctor"]
    config.write_text(yaml.safe_dump(raw))
    code, out = _doctor(config, capsys)
    assert code == 0, out
    assert "WARN  agent online           unknown: agent.yaml has no transport.broker.doctor login (doctor@a)" in out
    assert "hint: an agent of this device online on another machine would lose its session" in out
    assert "PASS  login accepted" in out


def test_a_doctor_login_the_broker_refuses_is_a_warning_naming_it(kit: tuple, capsys: pytest.CaptureFixture) -> None:
    """The broker refuses the doctor login (here: no client certificate on its TLS listener): a WARN naming it."""
    kits, _, root = kit
    (root / "wrong.password").write_text("not-the-doctor-password\n")
    config = _config(kits, root, "wrong-doctor")
    raw = yaml.safe_load(config.read_text())
    raw["transport"]["broker"]["doctor"] = {"password": f"file:{root / 'wrong.password'}"}  # and no certificate
    config.write_text(yaml.safe_dump(raw))
    code, out = _doctor(config, capsys)
    assert code == 0, out
    assert "WARN  agent online           could not ask the broker as doctor@a" in out
    assert "provision again and restart the coordinator" in out
