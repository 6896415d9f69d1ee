"""The operator's path, literally, as docs/devices.md and docs/export.md tell it, on Fashion-MNIST over TLS.

``coordinator provision``; each kit unpacked (``tar xzf``) into its own folder and started with
``device-agent run --kit``; ``coordinator start``; Ctrl-C after round 1; the same start command again,
which resumes the run and finishes it; ``coordinator export --merged`` and ``--ratio``; and
``device-agent infer`` in a venv without torch. Every command is a real process, as an operator types it.
The plan and the devices agree on what each trains (the planned samples are what each agent trains on).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from coordinator.transport.broker.base import free_port
from coordinator.transport.broker.mosquitto import find_mosquitto
from device_agent.data.datasets import FASHION_MNIST, FASHION_MNIST_DIR, load_dataset
from export.targets import FASHION_MNIST_CLASSES
from tests.e2e.conftest import run_torchless
from tests.processes import stop_processes, wait_for_text

pytestmark = pytest.mark.slow

DEVICES = {"lab-a": "x86-laptop-cpu", "lab-b": "x86-laptop-cpu", "pi5-c": "raspberry-pi-5"}
SAMPLES = 160
PI_SAMPLES = 96  # pi5-c's overrides.samples: the plan sizes it apart from the fleet's samples_per_device
ROUNDS = 3


def fleet_yaml(port: int) -> str:
    overrides = {"pi5-c": f", overrides: {{samples: {PI_SAMPLES}}}"}
    devices = "".join(
        f"  - {{id: {name}, profile: {profile}{overrides.get(name, '')}}}\n" for name, profile in DEVICES.items()
    )
    return (
        "fleet: fashion-lab\n"
        f"broker: {{mode: managed, host: 127.0.0.1, port: {port}, hosts: [localhost]}}\n"
        "model: {arch: cnn28, num_classes: 10}\n"
        f"dataset: {{name: fashion_mnist, partition: iid, samples_per_device: {SAMPLES}}}\n"
        "evaluation: {max_samples: 300}\n"
        "strategy: {name: fedhm}\n"
        f"ratios: [1, 1/2]\nrounds: {ROUNDS}\nround_deadline_s: 120\nquorum: 1.0\n"
        "training: {batch_size: 32, local_epochs: 1, lr: 0.05}\n"
        f"devices:\n{devices}"
    )


@pytest.fixture
def operator_home() -> Path:
    """A folder under /tmp the ``mosquitto`` user can traverse (pytest's own tmp folders are 0700)."""
    root = Path(tempfile.mkdtemp(prefix="fedfleet-operator-"))
    os.chmod(root, 0o711)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def command(home: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", *args], cwd=home, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(args)}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def test_provision_run_stop_resume_export_and_infer_without_torch(operator_home: Path, torchless_python: Path) -> None:
    if find_mosquitto() is None:
        pytest.skip("mosquitto is not installed (apt-get install mosquitto)")
    if not FASHION_MNIST_DIR.is_dir():
        pytest.skip("needs Debian's dataset-fashion-mnist")
    home = operator_home
    (home / "fleet.yaml").write_text(fleet_yaml(free_port()))
    command(home, "coordinator", "provision", "--fleet", "fleet.yaml", "--out", "kits")
    planned = json.loads(command(home, "coordinator", "plan", "--fleet", "fleet.yaml", "--json").stdout)
    levels = {row["device"]: row["ratio"] for row in planned}
    sized = {row["device"]: row["samples"] for row in planned}
    assert set(levels) == set(DEVICES) and sized == {"lab-a": SAMPLES, "lab-b": SAMPLES, "pi5-c": PI_SAMPLES}

    processes: list[subprocess.Popen] = []

    def spawn(name: str, *args: str) -> tuple[subprocess.Popen, Path]:
        log = home / f"{name}.log"
        process = subprocess.Popen(
            [sys.executable, "-m", *args], cwd=home, stdout=log.open("wb"), stderr=subprocess.STDOUT
        )
        processes.append(process)
        return process, log

    start = ("coordinator", "start", "--fleet", "fleet.yaml", "--kits", "kits", "--no-live", "--wait-timeout", "120")
    try:
        agents = {}
        for device in DEVICES:
            (home / device).mkdir()
            subprocess.run(["tar", "xzf", f"../kits/{device}.tar.gz"], cwd=home / device, check=True)
            agents[device] = spawn(device, "device_agent", "run", "--kit", f"{device}/{device}")[1]

        first, first_log = spawn("coordinator-1", *start)
        wait_for_text(first_log, "round 1 closed", first, timeout=240)
        first.send_signal(signal.SIGINT)
        first.wait(timeout=240)  # it writes the report on its way out: slow on a loaded host
        stopped = first_log.read_text()
        assert first.returncode == 0, stopped[-3000:]
        (run_dir,) = (home / "runs").iterdir()
        resume = f"stopped; resume with: coordinator {' '.join(start[1:])} --run-dir runs/{run_dir.name}"
        assert resume in stopped, stopped[-3000:]

        second, second_log = spawn("coordinator-2", *start)  # the same command: it resumes, it does not start anew
        second.wait(timeout=300)
        resumed = second_log.read_text()
        assert second.returncode == 0, resumed[-4000:]
        assert f"the fleet's newest run runs/{run_dir.name} is unfinished: resuming it" in resumed
        assert "all rounds done" in resumed and "FAILED" not in resumed
        assert [path.name for path in (home / "runs").iterdir()] == [run_dir.name]
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [m["round"] for m in metrics][-ROUNDS:] == list(range(1, ROUNDS + 1))
        assert all(m["participants"] == len(DEVICES) for m in metrics)
        for device, log in agents.items():  # plan and device agree: each trained the samples it was planned at
            text = log.read_text()
            at = f"level {levels[device]:g} on at most {sized[device]} samples"
            assert f"{device}: round 1: training at {at}" in text, text[-3000:]
            assert f"{device}: round {ROUNDS} trained on {sized[device]} samples" in text, text[-3000:]
            last_start = next(line for line in text.splitlines() if f"{device}: round {ROUNDS}: training at" in line)
            assert "s at the last round's pace" in last_start, last_start  # the time it expects, from round 1
    finally:
        stop_processes(processes)

    run = f"runs/{run_dir.name}"
    merged = command(home, "coordinator", "export", run, "--merged", "--out", "merged.onnx", "--no-latency")
    assert "top-1 agreement 100.0%" in merged.stdout
    half = command(home, "coordinator", "export", run, "--ratio", "1/2", "--out", "half.onnx", "--no-latency")
    assert "ratio:1/2" in half.stdout and "top-1 agreement 100.0%" in half.stdout

    helped = run_torchless(torchless_python, "-m", "device_agent", "--help")
    assert helped.returncode == 0 and "infer" in helped.stdout, helped.stderr
    test_x = load_dataset(FASHION_MNIST, 28, 1).test_x[:16]
    np.save(home / "shirts.npy", test_x[:, 0].numpy())
    for model in ("merged.onnx", "half.onnx"):
        inferred = run_torchless(
            torchless_python,
            "-m",
            "device_agent",
            "infer",
            "--model",
            str(home / model),
            str(home / "shirts.npy"),
            "--json",
        )
        assert inferred.returncode == 0, inferred.stderr
        rows = [json.loads(line) for line in inferred.stdout.splitlines()]
        assert len(rows) == 16 and all(row["top"][0]["class"] in FASHION_MNIST_CLASSES for row in rows)
