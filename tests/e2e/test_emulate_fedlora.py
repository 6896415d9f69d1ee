"""FedLoRA end to end: `coordinator pretrain`, then `coordinator emulate --fleet examples/fedlora.yaml` over mosquitto.

Four device classes train four LoRA ranks. Each upload is exactly the adapters and the head a real
LoRA program of that rank uploads (no frozen base weight), plus the protocol's framing; the frozen
base goes down with a device's first assignment only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import yaml

from coordinator.strategies import ClientSlot, ModelSpec, build_strategy
from coordinator.strategies.fedlora import FedLoRA
from coordinator.transport.broker.base import free_port
from coordinator.transport.broker.mosquitto import find_mosquitto
from device_agent.clients import build_program
from device_agent.data.datasets import FASHION_MNIST_DIR
from device_agent.wire.codec import encode_tensors
from tests.paths import REPO_ROOT

ROOT = REPO_ROOT
EXAMPLE = ROOT / "examples" / "fedlora.yaml"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed"),
    pytest.mark.skipif(not FASHION_MNIST_DIR.is_dir(), reason="Debian's dataset-fashion-mnist is not installed"),
]


def _coordinator(*args: str, timeout: float) -> None:
    # One thread each: on a small shared host, OpenMP spinning across busy cores costs minutes.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "coordinator", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_fedlora_trains_four_ranks_uploads_only_adapters_and_sends_the_base_once(tmp_path: Path) -> None:
    base = tmp_path / "base.safetensors"
    fleet = yaml.safe_load(EXAMPLE.read_text())
    # A short pre-training: what is checked here is what travels, not how good the base is.
    pretrain = ["pretrain", "--arch", fleet["model"]["arch"], "--dataset", fleet["dataset"]["name"], "--classes", "0-4"]
    _coordinator(*pretrain, "--samples", "300", "--epochs", "1", "--out", str(base), timeout=120)

    fleet["transport"]["broker"]["port"] = free_port()
    fleet["rounds"] = 2
    # Digits, which both sides resize to the ViT's 28x28: about 360 images per device, not 15,000.
    fleet["dataset"] = {"name": "digits", "partition": "dirichlet(1.0)", "seed": 0}
    fleet["strategy"]["params"]["base_checkpoint"] = str(base)
    fleet_file = tmp_path / "fleet.yaml"
    fleet_file.write_text(yaml.safe_dump(fleet, sort_keys=False))
    run_dir = tmp_path / "run"
    _coordinator("emulate", "--fleet", str(fleet_file), "--run-dir", str(run_dir), "--no-live", timeout=240)
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if str(run_dir) in " ".join(p.info["cmdline"] or [])]
    assert leftovers == [], "agents left running after the emulation ended"

    model = ModelSpec(fleet["model"]["arch"], 10, 1, 28)
    strategy = build_strategy("fedlora", model, fleet["strategy"]["params"], seed=fleet["dataset"]["seed"])
    assert isinstance(strategy, FedLoRA)
    base_bytes = len(encode_tensors(strategy.base))
    rounds = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2]

    adapter_bytes: dict[float, int] = {}
    for record in rounds:
        assert set(record["devices"]) == {d["id"] for d in fleet["devices"]}
        for name, device in record["devices"].items():
            assert device["status"] == "accepted", (record["round"], name, device["error"])
            ratio = device["ratio"]
            if ratio not in adapter_bytes:
                # What a real device program of this rank uploads: its A, B and the head, nothing frozen.
                [assignment] = strategy.configure(1, [ClientSlot(name, ratio, 1)]).values()
                upload = build_program(assignment.spec, assignment.tensors).upload()
                assert upload.keys() == strategy.expected_upload(ratio).keys()
                assert not upload.keys() & set(strategy.base)
                adapter_bytes[ratio] = len(encode_tensors(upload))
            assert device["payload_bytes"] == adapter_bytes[ratio], (name, ratio)
    ranks = {strategy.rank_of(strategy.params, ratio) for ratio in adapter_bytes}
    assert ranks == {16, 8, 4, 2}
    assert len({d["device_class"] for d in rounds[0]["devices"].values()}) >= 3
    assert sorted(adapter_bytes.values()) == [adapter_bytes[r] for r in sorted(adapter_bytes)]  # higher rank, more

    for name in rounds[0]["devices"]:
        first, second = rounds[0]["devices"][name], rounds[1]["devices"][name]
        # The upload is the adapter payload plus a fixed protocol cost (manifest sent and sealed, chunk
        # framing, upload meta with the device's evaluation figures, status messages), a couple of KB;
        # a resend under load (lost receipt) is real traffic, so only the cheapest round is held to it.
        cheapest = min(first["bytes_up"], second["bytes_up"])
        assert first["payload_bytes"] < cheapest < first["payload_bytes"] + 2048, (name, cheapest)
        # Round 1 carries the frozen base with the adapters; round 2 the adapters and the head only
        # (the same tensors as the upload), plus the assignment's spec and framing, a few hundred bytes.
        assert first["bytes_down"] > base_bytes + first["payload_bytes"], name
        assert second["payload_bytes"] < second["bytes_down"] < second["payload_bytes"] + 4096, name
        assert second["bytes_down"] * 5 < first["bytes_down"], name
