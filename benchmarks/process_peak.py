"""Predicted vs measured peak memory of a real agent process over a whole round (VmHWM).

For each model (the demo CNN and ResNet-18, both on 32x32 RGB inputs), two batch sizes and gamma 1
and 1/4: ``coordinator emulate`` runs one round of a two-device fleet (x86-laptop-cpu profiles, one
capped at gamma 1/4) on a small synthetic CIFAR-format .npz, and the peak resident set (``VmHWM``
of /proc/PID/status) of each real ``device-agent run`` process is read until it exits. The
prediction is the planner's own ``est_memory_bytes`` for that device
(:func:`profiles.costmodel.predict_process_peak`).

``calibrate_baseline`` measures the constant of that estimate, :data:`profiles.costmodel.AGENT_BASELINE_BYTES`:
the VmHWM of an idle agent (torch imported, profile probed, MQTT session running, no round yet).

    python -m benchmarks.emulation --memory --json
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import yaml

_ROOT = Path(__file__).resolve().parents[1]
_MIB = 2**20
CASES = {"cnn": (16, 64), "resnet18": (16, 32)}
GAMMAS = (1.0, 0.25)
SAMPLES = 1250  # 1000 training images (two shares of 500) and 250 test images, 32x32x3


def vm_hwm(pid: int) -> int | None:
    """Peak resident bytes of process ``pid`` so far (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def synthetic_npz(path: Path) -> Path:
    rng = np.random.default_rng(0)
    np.savez(path, x=rng.integers(0, 256, (SAMPLES, 32, 32, 3), dtype=np.uint8), y=rng.integers(0, 10, SAMPLES))
    return path


_IDLE_LINES = ("connecting to fleet", "cannot reach the broker")


def calibrate_baseline(settle_s: float = 3.0, timeout: float = 180.0) -> int:
    """VmHWM of an idle ``device-agent run`` (its broker unreachable: it keeps retrying, trains nothing).

    Read ``settle_s`` after the agent says it is connecting or waiting for the broker (torch imported,
    profile probed): on a loaded host the imports alone can take longer than any fixed wait.
    """
    with tempfile.TemporaryDirectory(prefix="fedfleet-bench-baseline-") as folder:
        config, log = Path(folder) / "agent.yaml", Path(folder) / "agent.log"
        agent_config = {
            "device": "idle",
            "fleet": "bench",
            "transport": {"broker": {"url": "mqtt://127.0.0.1:9"}},
            "device_type": "cpu",
            "state_dir": str(Path(folder) / "state"),
            "emulation": {"threads": 1},
        }
        config.write_text(yaml.safe_dump(agent_config))
        command = [sys.executable, "-m", "device_agent", "run", "--config", str(config)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with log.open("wb") as out:
            agent = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=_ROOT)
        try:
            deadline = time.monotonic() + timeout
            # The agent probes itself before it waits for the broker, so either line means it is idle.
            while not any(line in log.read_text(errors="replace") for line in _IDLE_LINES):
                if agent.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the idle agent did not start: {log.read_text(errors='replace')[-1000:]}")
                time.sleep(0.2)
            time.sleep(settle_s)
            peak = vm_hwm(agent.pid)
        finally:
            agent.send_signal(signal.SIGINT)
            agent.wait(30)
    if peak is None:
        raise RuntimeError("the idle agent exited before it could be measured")
    return peak


def _fleet(arch: str, batch: int, data: Path, port: int) -> dict:
    return {
        "fleet": "peak",
        "transport": {"broker": {"mode": "managed", "host": "127.0.0.1", "port": port}},
        "model": {"arch": arch, "num_classes": 10, "in_channels": 3, "image_size": 32},
        "dataset": {"name": "npz", "path": str(data), "partition": "iid", "samples_per_device": 500},
        "strategy": {"name": "fedhm"},
        "ratios": [1, "1/4"],
        "rounds": 1,
        "round_deadline_s": 600,
        "training": {"batch_size": batch, "local_epochs": 1, "lr": 0.05, "optimizer": "momentum"},
        "devices": [
            {"id": "gamma-1", "profile": "x86-laptop-cpu"},
            {"id": "gamma-4", "profile": "x86-laptop-cpu", "overrides": {"max_ratio": "1/4"}},
        ],
    }


def measure_case(arch: str, batch: int, data: Path, folder: Path, timeout: float = 600) -> list[dict]:
    """One round of the two-device fleet: per device, the planner's estimate and the agent's VmHWM."""
    from coordinator.config.fleet import load_fleet
    from coordinator.planning.planner import plan_fleet
    from coordinator.transport.broker.base import free_port

    folder = Path(tempfile.mkdtemp(prefix=f"{arch}-{batch}-", dir=folder))
    folder.chmod(0o755)  # the managed mosquitto drops to its own user and must reach its kit folder
    path, run_dir = folder / "fleet.yaml", folder / "run"
    path.write_text(yaml.safe_dump(_fleet(arch, batch, data, free_port()), sort_keys=False))
    fleet, catalog = load_fleet(path)
    plans = {plan.device: plan for plan in plan_fleet(fleet, catalog)}
    command = [sys.executable, "-m", "coordinator", "emulate", "--fleet", str(path), "--run-dir", str(run_dir)]
    emulate = subprocess.Popen([*command, "--no-live"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=_ROOT)
    peaks: dict[str, int] = {}
    deadline = time.monotonic() + timeout
    parent = psutil.Process(emulate.pid)
    while emulate.poll() is None and time.monotonic() < deadline:
        try:
            children = parent.children()
        except psutil.NoSuchProcess:
            break
        for child in children:
            try:
                line = child.cmdline()
            except psutil.NoSuchProcess:
                continue
            device = next((d for d in plans if any(f"/{d}/agent.yaml" in part for part in line)), None)
            peak = vm_hwm(child.pid) if device else None
            if device and peak:
                peaks[device] = max(peaks.get(device, 0), peak)
        time.sleep(0.1)
    if emulate.poll() is None:
        emulate.kill()
    output = emulate.communicate()[0].decode(errors="replace")
    if emulate.returncode != 0:
        raise RuntimeError(f"coordinator emulate failed ({emulate.returncode}): {output[-2000:]}")
    rows = []
    for device, plan in plans.items():
        predicted, measured = plan.est_memory_bytes or 0, peaks.get(device, 0)
        rows.append(
            {
                "arch": arch,
                "batch_size": batch,
                "gamma": plan.ratio,
                "predicted_mib": round(predicted / _MIB, 1),
                "measured_mib": round(measured / _MIB, 1),
                "predicted_vs_measured": round(predicted / measured, 3) if measured else None,
            }
        )
    return rows


def process_peak() -> dict:
    """Every case, plus the baseline measured now next to the constant the estimate uses."""
    from profiles.costmodel import AGENT_BASELINE_BYTES

    baseline = calibrate_baseline()
    rows = []
    with tempfile.TemporaryDirectory(prefix="fedfleet-bench-peak-") as name:
        folder = Path(name)
        folder.chmod(0o755)
        data = synthetic_npz(folder / "synthetic.npz")
        for arch, batches in CASES.items():
            for batch in batches:
                try:
                    rows += measure_case(arch, batch, data, folder)
                except RuntimeError:  # a managed broker slow to come up on a loaded host: once more
                    rows += measure_case(arch, batch, data, folder)
    ratios = [row["predicted_vs_measured"] for row in rows if row["predicted_vs_measured"]]
    return {
        "idle_agent_vmhwm_mib": round(baseline / _MIB, 1),
        "baseline_constant_mib": round(AGENT_BASELINE_BYTES["cpu"] / _MIB, 1),
        "cases": rows,
        "worst_error": round(max(abs(r - 1) for r in ratios), 3) if ratios else None,
        "within_15_percent": bool(ratios) and all(abs(r - 1) <= 0.15 for r in ratios),
    }


def describe(result: dict) -> list[str]:
    idle, constant = result["idle_agent_vmhwm_mib"], result["baseline_constant_mib"]
    lines = [f"idle agent VmHWM {idle} MiB (baseline constant {constant} MiB)"]
    for row in result["cases"]:
        lines.append(
            f"{row['arch']} batch {row['batch_size']} gamma {row['gamma']:g}: predicted {row['predicted_mib']} MiB, "
            f"measured {row['measured_mib']} MiB, ratio {row['predicted_vs_measured']}"
        )
    lines.append(f"worst error {result['worst_error']}; within 15 %: {result['within_15_percent']}")
    return lines


if __name__ == "__main__":
    print(json.dumps(process_peak()))
