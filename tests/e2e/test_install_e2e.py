"""A provisioned 3-device fleet end to end over TLS, one device installed from its kit as on a real device.

Device ``a`` is installed by its kit's install.sh into a fresh venv (torch and the other dependencies
come from this test environment through a ``.pth`` file, so nothing is downloaded) and started with
the exact command line of the kit's systemd unit; ``b`` and ``c`` run from this environment with
their kits' files. The coordinator runs ``coordinator start --kits``: mosquitto from kits/broker.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import site
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from coordinator.transport.broker.mosquitto import find_mosquitto
from tests.coordinator.provision.kit_fixtures import make_fleet, provision_into
from tests.processes import stop_processes

pytestmark = pytest.mark.slow


def _exec_start(unit: Path) -> list[str]:
    line = next(x for x in unit.read_text().splitlines() if x.startswith("ExecStart="))
    return shlex.split(line.removeprefix("ExecStart="))


def _install(kit: Path, prefix: Path) -> None:
    """install.sh with the venv pre-made to see this environment's packages (torch, numpy...) and no index."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(prefix / "venv")], check=True)
    venv_site = next((prefix / "venv" / "lib").glob("python3*/site-packages"))
    (venv_site / "test-env.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    env = {**os.environ, "NO_SERVICE": "1", "PIP_NO_INDEX": "1", "PYTHON": sys.executable}
    result = subprocess.run(["sh", str(kit / "install.sh")], env=env, capture_output=True, text=True, cwd="/")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "torch: already installed" in result.stdout


def test_a_kit_installs_and_trains_over_tls_with_the_rest_of_the_fleet() -> None:
    if find_mosquitto() is None:
        pytest.skip("mosquitto is not installed")
    fleet_file, fleet = make_fleet(rounds=2)
    root = fleet_file.parent
    kits = provision_into(fleet, root)
    prefix = root / "opt"
    _install(kits.participant("a"), prefix)
    installed = subprocess.run(
        [str(prefix / "venv" / "bin" / "python"), "-c", "import device_agent; print(device_agent.__file__)"],
        capture_output=True,
        text=True,
        cwd="/",
    )
    assert str(prefix / "venv") in installed.stdout  # the wheel's copy, not this checkout
    assert not (prefix / "venv" / "bin" / "coordinator").exists()
    assert (prefix / "etc" / "password").stat().st_mode & 0o777 == 0o600

    logs: dict[str, Path] = {}
    processes: dict[str, subprocess.Popen] = {}

    def spawn(name: str, command: list[str]) -> None:
        logs[name] = root / f"{name}.log"
        processes[name] = subprocess.Popen(command, cwd="/", stdout=logs[name].open("wb"), stderr=subprocess.STDOUT)

    run_dir = root / "run"
    spawn(
        "coordinator",
        [
            *(sys.executable, "-m", "coordinator", "start", "--fleet", str(fleet_file), "--kits", str(kits.root)),
            *("--run-dir", str(run_dir), "--no-live", "--min-devices", "3", "--wait-timeout", "120"),
        ],
    )
    try:
        deadline = time.monotonic() + 60
        while "broker: mqtts://" not in logs["coordinator"].read_text() and time.monotonic() < deadline:
            assert processes["coordinator"].poll() is None, logs["coordinator"].read_text()
            time.sleep(0.2)
        doctor = subprocess.run(
            [str(prefix / "venv" / "bin" / "device-agent"), "doctor", "--config", str(prefix / "etc" / "agent.yaml")],
            capture_output=True,
            text=True,
            cwd="/",
        )
        assert doctor.returncode == 0, doctor.stdout + doctor.stderr
        assert "PASS  TLS verifies" in doctor.stdout and "PASS  may write own topics" in doctor.stdout
        spawn("a", _exec_start(kits.participant("a") / "fedfleet-agent.service"))
        for device in ("b", "c"):
            kit = kits.participant(device)
            spawn(
                device,
                [
                    *(sys.executable, "-m", "device_agent", "run", "--config", str(kit / "agent.yaml")),
                    *("--password", f"file:{kit / 'password'}", "--ca-file", str(kit / "ca.pem")),
                    *("--cert-file", str(kit / "client.pem"), "--key-file", str(kit / "client.key")),
                    *("--state-dir", str(root / f"state-{device}")),
                ],
            )
        peak_rss = 0
        deadline = time.monotonic() + 240
        while processes["coordinator"].poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(psutil.NoSuchProcess):
                peak_rss = max(peak_rss, psutil.Process(processes["a"].pid).memory_info().rss)
            time.sleep(0.2)
        output = logs["coordinator"].read_text()
        assert processes["coordinator"].returncode == 0, output + logs["a"].read_text()[-3000:]
        assert "all rounds done" in output
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [m["round"] for m in metrics] == [1, 2]
        assert "a: online" in output
        print(f"device a: peak RSS while training {peak_rss / 2**20:.0f} MiB")
    finally:
        stop_processes(processes.values(), timeout=20)
