"""``device-agent doctor`` on the device side: a running agent's session is left alone (from this state dir
or another copy of the kit), torch is judged without crashing, and an unpacked kit is checked where it lies
(real mosquitto with the kit's TLS)."""

from __future__ import annotations

import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import paho.mqtt.client as mqtt
import pytest
import torch
import yaml
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion

from device_agent.agent.config import load_kit
from device_agent.agent.lock import hold
from device_agent.cli import doctor
from device_agent.cli.app import main
from device_agent.cli.doctor import TORCH_CPU_INDEX, AgentConfig, check_cpu, check_torch
from device_agent.wire.messages import Status, encode
from device_agent.wire.session import BrokerAddress
from device_agent.wire.topics import DeviceTopics
from tests.coordinator.provision.kit_fixtures import kit_broker, make_fleet, provision_into
from tests.device_agent.recorder_port import agent_yaml, recorder_installed
from tests.paths import REPO_ROOT
from tests.processes import wait_for_text


@pytest.fixture(scope="module")
def kit() -> Iterator[Path]:
    """Device a's unpacked kit, its broker running; its agent.yaml names install paths that do not exist here."""
    fleet_file, fleet = make_fleet()
    kits = provision_into(fleet, fleet_file.parent)
    broker = kit_broker(fleet, kits)
    broker.start()
    yield kits.participant("a")
    broker.stop()


def _doctor(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["doctor", *args, "--timeout", "3"])
    return code, capsys.readouterr().out


def test_load_kit_takes_the_kits_files_and_state_not_the_install_paths(kit: Path) -> None:
    written = yaml.safe_load((kit / "agent.yaml").read_text())
    assert written["transport"]["broker"]["ca_file"] != str(kit / "ca.pem")  # the kit names where install.sh puts it
    config = load_kit(kit)
    assert config.broker.ca_file == str(kit / "ca.pem")
    assert (config.broker.cert_file, config.broker.key_file) == (str(kit / "client.pem"), str(kit / "client.key"))
    assert config.broker.password == f"file:{kit / 'password'}"
    doctor = config.broker.doctor  # the read-only login doctor asks the broker with, from the kit too
    assert doctor is not None and doctor.password == f"file:{kit / 'doctor.password'}"
    assert (doctor.cert_file, doctor.key_file) == (str(kit / "doctor.pem"), str(kit / "doctor.key"))
    assert config.state_dir == kit / "state"
    assert load_kit(kit, {"state_dir": "/elsewhere"}).state_dir == Path("/elsewhere")  # flags still win


def test_doctor_checks_an_unpacked_kit_where_it_lies(kit: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _doctor(capsys, "--kit", str(kit))
    assert code == 0, out
    assert f"PASS  config                 kit {kit}: device a" in out
    assert "PASS  login accepted" in out and "PASS  may write own topics" in out


def test_doctor_leaves_a_running_agents_session_alone(kit: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The broker takes the login as client id: doctor's login would disconnect the agent, so it is skipped."""
    with hold(kit / "state"):
        code, out = _doctor(capsys, "--kit", str(kit))
        assert code == 0, out
        assert f"SKIP  login accepted         skipped: the agent is running (pid {os.getpid()}" in out
        assert "--force" in out and "may write own topics" not in out
        assert "PASS  TLS verifies" in out  # the checks that log in as nobody still run
        code, out = _doctor(capsys, "--kit", str(kit), "--force")
    assert code == 0, out
    assert "PASS  login accepted" in out


def test_cpu_count_and_architecture_are_reported() -> None:
    line = check_cpu().line()
    assert line.startswith("PASS  cpu") and f"{os.cpu_count()} CPUs, {platform.machine()}" in line


def _config() -> AgentConfig:
    return AgentConfig(device="a", fleet="f")


def test_a_cuda_torch_without_a_gpu_is_a_warning_with_the_cpu_index(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    checks = check_torch(_config())
    assert [c.ok for c in checks] == [True, True]
    warning = checks[1].line()
    assert warning.startswith("WARN  torch build") and "built for CUDA 12.4" in warning
    assert f"--index-url {TORCH_CPU_INDEX}" in warning


def test_a_cpu_torch_has_no_build_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert [c.name for c in check_torch(_config())] == ["torch and accelerator"]


def test_a_missing_torch_is_a_failed_check_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    (check,) = check_torch(_config())
    assert check.ok is False and "does not import: ModuleNotFoundError" in check.line() and "hint:" in check.line()


def test_a_broken_torch_is_a_failed_check_not_a_crash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch whose shared library is missing raises OSError on import, not ImportError."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise OSError('libtorch_cuda.so: cannot open shared object')\n")
    monkeypatch.delitem(sys.modules, "torch")
    monkeypatch.syspath_prepend(str(tmp_path))
    (check,) = check_torch(_config())
    assert check.ok is False and "OSError: libtorch_cuda.so" in check.detail


def test_run_from_a_kit_refuses_to_start_beside_a_running_agent(kit: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``run --kit`` reads the kit's state dir; a second agent there would take over the first one's session."""
    with hold(kit / "state"):
        code = main(["run", "--kit", str(kit), "--log-level", "ERROR"])
    err = capsys.readouterr().err
    assert code == 1
    assert f"another device agent (pid {os.getpid()}) is running with state dir {kit / 'state'}" in err


def _copy(kit: Path, to: Path) -> Path:
    """An unpacked copy of the kit with a state dir of its own, as a second `tar x` elsewhere makes."""
    shutil.copytree(kit, to, ignore=shutil.ignore_patterns("state"))
    return to


@pytest.mark.slow
def test_doctor_on_another_copy_of_the_kit_leaves_the_online_agent_alone(
    kit: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A real agent runs from one unpacked copy; doctor (and a second agent) on another copy, whose state dir
    holds no lock, must not log in as the device: on the real broker that login would drop the agent."""
    first, second = _copy(kit, tmp_path / "first"), _copy(kit, tmp_path / "second")
    log = tmp_path / "agent.log"
    with open(log, "wb") as out:
        agent = subprocess.Popen(
            [sys.executable, "-m", "device_agent", "run", "--kit", str(first), "--log-level", "INFO"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        )
    try:
        wait_for_text(log, "connected to mqtts://localhost", agent)
        code, out = _doctor(capsys, "--kit", str(second))
        assert code == 0, out
        assert "SKIP  login accepted         skipped: an agent for localhost:" in out
        assert "/kitfleet/a is running on this machine (another copy of the kit or another state dir)" in out
        assert "PASS  TLS verifies" in out and "may write own topics" not in out
        assert main(["run", "--kit", str(second), "--log-level", "ERROR"]) == 1
        assert "/kitfleet/a is running on this machine" in capsys.readouterr().err
        time.sleep(1.5)  # a takeover shows at once in the agent's log; a session reconnects after ~1 s
        assert "disconnected from" not in log.read_text()
        # What the check prevents: doctor's login, forced, takes the agent's place on the broker.
        code, out = _doctor(capsys, "--kit", str(second), "--force")
        assert code == 0 and "PASS  login accepted" in out, out
        wait_for_text(log, "disconnected from", agent, timeout=10)
    finally:
        agent.send_signal(signal.SIGINT)
        agent.wait(30)
    code, out = _doctor(capsys, "--kit", str(second))
    assert code == 0 and "PASS  login accepted" in out, out


@pytest.mark.slow
def test_doctor_asks_the_broker_and_leaves_an_agent_on_another_machine_alone(
    kit: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent runs "on another machine": this machine's claim cannot see it (patched to see nothing, as
    there), so only the broker knows. Doctor asks it with the kit's read-only login doctor@a, reads a's
    retained status, and does not log in as a: the agent keeps its session, the broker still says online."""
    monkeypatch.setattr(doctor, "device_running_here", lambda key: False)
    first, second = _copy(kit, tmp_path / "first"), _copy(kit, tmp_path / "second")
    log = tmp_path / "agent.log"
    with open(log, "wb") as out:
        agent = subprocess.Popen(
            [sys.executable, "-m", "device_agent", "run", "--kit", str(first), "--log-level", "INFO"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        )
    online = "PASS  agent online           yes: the broker says a's agent is online ("
    try:
        wait_for_text(log, "connected to mqtts://localhost", agent)
        for _ in range(2):  # the second asking still finds the agent online: the first one took nothing over
            code, out = _doctor(capsys, "--kit", str(second))
            assert code == 0, out
            assert online in out, out
            assert "SKIP  login accepted         skipped: the broker says a's agent is online" in out
            assert "may write own topics" not in out
        time.sleep(1.5)  # a takeover shows at once in the agent's log; a session reconnects after ~1 s
        assert "disconnected from" not in log.read_text()
    finally:
        agent.send_signal(signal.SIGINT)
        agent.wait(30)
    code, out = _doctor(capsys, "--kit", str(second))
    assert code == 0, out
    assert "PASS  agent online           no: the broker's last status of a is offline (stopped)" in out
    assert "PASS  login accepted" in out


def _client(address: BrokerAddress) -> mqtt.Client:
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=address.username, protocol=MQTTProtocolVersion.MQTTv5)
    client.username_pw_set(address.username, address.password)
    client.tls_set(address.ca_file, address.cert_file, address.key_file)
    client.connect(address.host, address.port)
    client.loop_start()
    return client


def _kit_address(folder: Path, user: str, prefix: str = "") -> BrokerAddress:
    """``user``'s login from the kit files ``prefix``password, ``prefix``pem and ``prefix``key (doctor's: doctor.)."""
    config = load_kit(folder)
    password = (folder / (f"{prefix}password" if prefix else "password")).read_text().strip()
    cert = folder / (f"{prefix}pem" if prefix else "client.pem")
    key = folder / (f"{prefix}key" if prefix else "client.key")
    port = urlsplit(config.broker.url).port or 8883
    return BrokerAddress("localhost", port, user, password, True, config.broker.ca_file, str(cert), str(key))


def test_the_doctor_login_reads_its_devices_status_and_nothing_else(kit: Path) -> None:
    """doctor@a on the real broker: of the fleet's retained messages it receives a's status alone, and
    every publish (a's status, the subtree the device patterns would give its own name) is refused."""
    assert load_kit(kit).broker.doctor.cert_file == str(kit / "doctor.pem")
    for device in ("a", "b"):  # each device leaves a retained status, as its agent does
        client = _client(_kit_address(kit.parent / device, device))
        status = encode(Status(device=device, state="offline", detail="test"))
        client.publish(DeviceTopics("kitfleet", device).status, status, qos=1, retain=True).wait_for_publish(10)
        client.disconnect()
        client.loop_stop()
    received: list[str] = []
    acks: dict[int, object] = {}
    client = _client(_kit_address(kit, "doctor@a", "doctor."))
    client.on_message = lambda _c, _u, message: received.append(message.topic)
    client.on_publish = lambda _c, _u, mid, reason, _p: acks.__setitem__(mid, reason)
    try:
        client.subscribe("fedfleet/kitfleet/#", qos=1)
        own_subtree = "fedfleet/kitfleet/dev/doctor@a/up/status"  # the device patterns alone would grant it this
        mids = [
            client.publish(topic, b"{}", qos=1).mid for topic in (DeviceTopics("kitfleet", "a").status, own_subtree)
        ]
        deadline = time.monotonic() + 60
        while len(acks) < len(mids) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        client.disconnect()
        client.loop_stop()
    assert received == ["fedfleet/kitfleet/dev/a/up/status"]  # a's retained status; not b's, not its own writes
    assert [acks[mid].is_failure for mid in mids] == [True, True], acks


def test_doctor_refuses_an_unknown_port_kind_in_its_config_check(tmp_path: Path) -> None:
    checks = doctor.diagnose(agent_yaml(tmp_path, "pigeon"))

    assert [(c.name, c.ok) for c in checks] == [("config", False)]
    assert "transport.kind: 'pigeon' is not a registered port kind (registered: mqtt" in checks[0].detail


def test_doctor_skips_the_way_of_a_port_kind_without_checks_and_checks_this_machine_for_any(tmp_path: Path) -> None:
    with recorder_installed(tmp_path / "site"):
        checks = {check.name: check for check in doctor.diagnose(agent_yaml(tmp_path / "dev-a"))}

    assert checks["config"].ok and checks["coordinator"].ok is None
    assert checks["coordinator"].detail == ("skipped: port kind 'recorder' has no checks of the way to the coordinator")
    assert "login accepted" not in checks and "secrets readable" not in checks
    assert checks["data"].ok and checks["cpu"].ok  # what the machine needs whatever the transport
