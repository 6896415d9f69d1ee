"""The main demo, end to end: `coordinator emulate --fleet examples/demo.yaml` with real agents and mosquitto.

Only the broker port is changed (a free one), so the test never collides with a demo someone is running.
The GPU variant runs the same machinery with the agents on CUDA, capped by a per-process memory fraction.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml

from coordinator.transport.broker.base import free_port
from coordinator.transport.broker.mosquitto import find_mosquitto
from tests.paths import REPO_ROOT

ROOT = REPO_ROOT
DEMO = ROOT / "examples" / "demo.yaml"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed"),
]


def _fleet_copy(tmp_path: Path, **changes: object) -> Path:
    fleet = yaml.safe_load(DEMO.read_text())
    fleet["transport"]["broker"]["port"] = free_port()
    fleet.update(changes)
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(fleet, sort_keys=False))
    return path


def _emulate(fleet: Path, run_dir: Path, *extra: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "coordinator", "emulate", "--fleet", str(fleet), "--run-dir", str(run_dir)]
    done = subprocess.run([*command, "--no-live", *extra], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if str(run_dir) in " ".join(p.info["cmdline"] or [])]
    assert leftovers == [], "agents left running after the emulation ended"
    return done


def _rounds(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_demo_reaches_90_percent_with_three_classes_and_three_ratios(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = _emulate(_fleet_copy(tmp_path), run_dir)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rounds = _rounds(run_dir)
    assert len(rounds) == yaml.safe_load(DEMO.read_text())["rounds"]
    assert rounds[-1]["accuracy"] >= 0.90
    devices = rounds[-1]["devices"]
    assert len(devices) >= 8
    assert len({d["device_class"] for d in devices.values()}) >= 3
    assert len({d["ratio"] for d in devices.values()}) >= 3
    overheads: dict[str, list[float]] = {}
    for record in rounds:
        for name, device in record["devices"].items():
            if device["status"] == "accepted":
                overheads.setdefault(name, []).append(device["bytes_up"] / device["payload_bytes"])
    for name, ratios_up in overheads.items():
        # the upload is the factor payload plus the protocol's manifest and chunk framing; a resend
        # under load (lost receipt) is real traffic, so only the cheapest round is held to 5 %
        assert min(ratios_up) > 1.0, name
        assert min(ratios_up) < 1.05, (name, ratios_up)
    ratios = {d["ratio"]: d["payload_bytes"] for d in devices.values()}
    assert ratios[1.0] > ratios[0.5] > ratios[0.25]  # lower rank, smaller upload
    assert (run_dir / "report.html").is_file()
    for device in devices:
        log = (run_dir / "agents" / device / "agent.log").read_text()
        assert f"{device}: round {len(rounds)}: training at level {devices[device]['ratio']:g} on " in log
        assert f"{device}: round {len(rounds)} trained" in log


def test_ctrl_c_stops_the_coordinator_and_every_agent_cleanly(tmp_path: Path) -> None:
    devices = yaml.safe_load(DEMO.read_text())["devices"][::3]  # one device of each class
    fleet = _fleet_copy(tmp_path, rounds=100, devices=devices)
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "coordinator", "emulate", "--fleet", str(fleet), "--run-dir", str(run_dir)]
    emulate = subprocess.Popen([*command, "--no-live"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while not (run_dir / "metrics.jsonl").is_file() or not (run_dir / "metrics.jsonl").read_text():
            assert emulate.poll() is None and time.monotonic() < deadline, "no round completed"
            time.sleep(0.5)
        children = psutil.Process(emulate.pid).children()  # the agents and the managed mosquitto
        assert len(children) > len(devices)
        emulate.send_signal(signal.SIGINT)
        output, _ = emulate.communicate(timeout=60)
    finally:
        if emulate.poll() is None:
            emulate.kill()
    assert emulate.returncode == 0, output[-3000:]
    assert f"stopped; resume with: coordinator emulate --fleet {fleet} --run-dir {run_dir}" in output
    assert "crashed" not in output
    assert not any(child.is_running() for child in children)
    for device in devices:
        assert "Traceback" not in (run_dir / "agents" / device["id"] / "agent.log").read_text()


_CAP_CHECK = """
import torch
from device_agent.agent.config import load_config
from device_agent.emulation.limits import runtime_hooks
config = load_config({config!r})
hooks = runtime_hooks(config.emulation, torch.device("cuda"))
cap = config.emulation.memory_bytes
held = torch.empty(cap // 2, dtype=torch.uint8, device="cuda")  # kept: a freed block would be reused
try:
    torch.empty(cap, dtype=torch.uint8, device="cuda")
except torch.OutOfMemoryError:
    print("capped at", cap)
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_variant_caps_each_agent_with_a_memory_fraction(tmp_path: Path) -> None:
    """Three Jetson classes on the GPU, each step held to its profile's predicted step time (device time)."""
    devices = [
        {"id": "orin8-01", "profile": "jetson-orin-nano-8gb"},
        {"id": "orin4-01", "profile": "jetson-orin-nano-4gb", "overrides": {"max_ratio": "1/2"}},
        {"id": "nano-01", "profile": "jetson-nano", "overrides": {"max_ratio": "1/4"}},
    ]
    fleet = _fleet_copy(tmp_path, rounds=2, round_deadline_s=300, devices=devices)
    run_dir = tmp_path / "run"
    done = _emulate(fleet, run_dir, "--device-type", "cuda", timeout=500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rounds = _rounds(run_dir)
    assert len(rounds) == 2
    assert all(d["status"] == "accepted" for r in rounds for d in r["devices"].values())
    assert {d["ratio"] for d in rounds[-1]["devices"].values()} == {1.0, 0.5, 0.25}
    for device in rounds[-1]["devices"]:
        config = run_dir / "agents" / device / "agent.yaml"
        assert yaml.safe_load(config.read_text())["device_type"] == "cuda"
        check = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(_CAP_CHECK.format(config=str(config)))],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert check.stdout.startswith("capped at"), check.stderr[-2000:]
