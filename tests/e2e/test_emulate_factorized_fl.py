"""Factorized-FL end to end: `coordinator emulate --fleet examples/factorized_fl.yaml`, real agents and mosquitto.

Devices upload only their u vectors and the v of the second-to-last layer, keep the rest on disk
between rounds (so it survives the agents being restarted with the run), and report their local
test accuracy; the coordinator keeps one personalized u per device in the run's checkpoint.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from safetensors.torch import load_file

from coordinator.strategies import ClientSlot, ModelSpec, build_strategy
from coordinator.strategies.factorized_fl import FactorizedFL
from coordinator.transport.broker.base import free_port
from coordinator.transport.broker.mosquitto import find_mosquitto
from device_agent.clients import build_program
from device_agent.wire.codec import encode_tensors
from tests.paths import REPO_ROOT

ROOT = REPO_ROOT
EXAMPLE = ROOT / "examples" / "factorized_fl.yaml"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed"),
]


def _fleet_copy(tmp_path: Path, rounds: int) -> tuple[Path, dict]:
    fleet = yaml.safe_load(EXAMPLE.read_text())
    fleet["transport"]["broker"]["port"] = free_port()
    fleet["rounds"] = rounds
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(fleet, sort_keys=False))
    return path, fleet


def _emulate(fleet: Path, run_dir: Path, *extra: str, failed: str | None = None) -> None:
    """Run the emulation; ``failed``: the "rounds failed" line it must end with (and exit 1), else exit 0."""
    command = [sys.executable, "-m", "coordinator", "emulate", "--fleet", str(fleet), "--run-dir", str(run_dir)]
    done = subprocess.run([*command, "--no-live", *extra], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == (0 if failed is None else 1), done.stdout[-3000:] + done.stderr[-3000:]
    assert failed is None or failed in done.stderr, done.stderr[-3000:]
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if str(run_dir) in " ".join(p.info["cmdline"] or [])]
    assert leftovers == [], "agents left running after the emulation ended"


def _payload_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return len(encode_tensors(tensors))


def _fedavg_upload_bytes(model: ModelSpec) -> int:
    """What one FedAvg client uploads for the same (dense) model: built by the real FedAvg program."""
    [assignment] = build_strategy("fedavg", model, {}).configure(1, [ClientSlot("any", 1.0, 1)]).values()
    return _payload_bytes(build_program(assignment.spec, assignment.tensors).upload())


def test_factorized_fl_uploads_only_u_keeps_private_parts_across_restarts_and_restarts_a_wiped_device(
    tmp_path: Path,
) -> None:
    fleet_file, fleet = _fleet_copy(tmp_path, rounds=2)
    devices = [d["id"] for d in fleet["devices"]]
    run_dir = tmp_path / "run"
    _emulate(fleet_file, run_dir)

    model = ModelSpec("cnn", 10, 1, 8)
    strategy = build_strategy("factorized_fl", model, fleet["strategy"]["params"], seed=fleet["dataset"]["seed"])
    assert isinstance(strategy, FactorizedFL)
    u_only = {k: strategy.init_state[k] for k in [*strategy.keys, strategy.similarity_key]}
    assert all(k.endswith(".u") for k in strategy.keys) and strategy.similarity_key.endswith(".v")
    u_only_bytes = _payload_bytes(u_only)
    fedavg_bytes = _fedavg_upload_bytes(model)

    rounds = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2]
    for record in rounds:
        assert set(record["devices"]) == set(devices)
        for name, device in record["devices"].items():
            assert device["status"] == "accepted", (record["round"], name, device["error"])
            # The coordinator accepts only exactly these tensor names and shapes; the payload is their size.
            assert device["payload_bytes"] == u_only_bytes
            assert device["bytes_up"] > device["payload_bytes"]
            assert 0 <= device["local_accuracy"] <= 1
        mean = sum(d["local_accuracy"] for d in record["devices"].values()) / len(devices)
        assert record["personalized_accuracy"] == pytest.approx(mean)
    for name in devices:
        # The cheapest round is the upload plus framing; a resend under load (lost receipt) is real
        # traffic and stays visible in bytes_up, so it is not held to the ratio.
        cheapest = min(record["devices"][name]["bytes_up"] for record in rounds)
        assert cheapest / u_only_bytes < 1.05, (name, cheapest)
        assert fedavg_bytes / cheapest >= 10, (fedavg_bytes, cheapest)
    # Round 1 sends each device the whole model; after that only its personalized u vectors travel down.
    for name in devices:
        assert rounds[1]["devices"][name]["bytes_down"] * 50 < rounds[0]["devices"][name]["bytes_down"]
    # Under permuted labels the global model is only a reference; the personalized models are what learns.
    assert rounds[-1]["personalized_accuracy"] > rounds[-1]["accuracy"] + 0.2

    checkpoint = load_file(run_dir / "state" / "round-000002.safetensors")
    for name in devices:
        personal = {k.split("/", 2)[2] for k in checkpoint if k.startswith(f"client/{name}/")}
        assert personal == set(strategy.keys)

    # Resume with fresh agent processes; one device lost its kept state (its state folder was wiped).
    wiped = devices[0]
    shutil.rmtree(run_dir / "agents" / wiped / "state" / "kept")
    # Round 3 misses the quorum (1.0) without the wiped device: it closes with 3 of 4, and the run says so.
    _emulate(fleet_file, run_dir, "--rounds", "4", failed="1 of 4 rounds failed")
    rounds = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2, 3, 4]
    third, fourth = rounds[2]["devices"], rounds[3]["devices"]
    assert third[wiped]["status"] == "failed" and third[wiped]["error"].startswith("state_lost: ")
    for name in devices[1:]:
        # A partial assignment trained on a restarted agent: its private part came back from disk.
        assert third[name]["status"] == "accepted"
        assert third[name]["bytes_down"] * 50 < rounds[0]["devices"][name]["bytes_down"]
    assert fourth[wiped]["status"] == "accepted"
    assert fourth[wiped]["bytes_down"] > 50 * fourth[devices[1]]["bytes_down"]  # started over with a whole model
