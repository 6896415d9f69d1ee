"""Differential privacy under secure aggregation: the devices add the noise, the coordinator adds none.

simulate(), FedAvg, 5 real agents over the in-memory transport: each clips its update to C, adds its share
N(0, (z C)^2 / 5) per value and masks the result; the coordinator unmasks the sum and divides by the survivors.
Two runs with the same seeds, z = 2 and z = 0.01, differ by the noise alone: per value std z C / 5 for the mean.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from benchmarks.screening import OFF
from coordinator.emulation.simulation import SimClient, simulate
from coordinator.privacy.accountant import planned_epsilon
from coordinator.strategies import ModelSpec, build_strategy
from device_agent.data.datasets import load_dataset
from device_agent.data.partition import PartitionSpec, client_shard
from device_agent.training.optimizer import TrainConfig

DEVICES, CLIP, DELTA = 5, 0.5, 1e-3
SECURE = {"threshold": 3, "neighbours": 4, "clip": 3.0, "bits": 16}
"""clip: the quantization range covers 6 stds of a device's noise, 2 x 0.5 / sqrt(5) = 0.447 (fleet.yaml demands it)."""


def clients() -> list[SimClient]:
    data = load_dataset("digits", 8, 1)
    spec = PartitionSpec("iid", DEVICES, seed=0)
    shards = [client_shard(data.train_x, data.train_y, spec, i) for i in range(DEVICES)]
    return [SimClient(f"c{i}", 1.0, shard, shards[0]) for i, shard in enumerate(shards)]


def run(run_dir: Path, z: float) -> None:
    data = load_dataset("digits", 8, 1)
    simulate(
        build_strategy("fedavg", ModelSpec("cnn", 10, 1, 8), {}, seed=0),
        clients(),
        1,
        TrainConfig(epochs=1, seed=0),
        (data.test_x, data.test_y),
        data.train_x[:128],
        limits=OFF,
        privacy={"noise_multiplier": z, "clip": CLIP, "delta": DELTA},
        secure_aggregation=SECURE,
        run_dir=run_dir,
    )


@pytest.mark.slow
def test_devices_add_the_noise_and_the_ledger_charges_it(tmp_path: Path) -> None:
    run(tmp_path / "noisy", z=2.0)
    run(tmp_path / "quiet", z=0.01)

    noisy, quiet = (load_file(tmp_path / d / "state" / "round-000001.safetensors") for d in ("noisy", "quiet"))
    keys = [k for k in noisy if noisy[k].is_floating_point() and "running" not in k and "num_batches" not in k]
    difference = torch.cat([(noisy[k] - quiet[k]).double().reshape(-1) for k in keys])
    # The mean of 5 clipped updates plus noise of std z C sqrt(5 / 5) on the sum: z C / 5 per value of the mean
    # (the quiet run's noise, 0.005 of it, is negligible). ~100 k values: the std is within 2 % of it.
    expected = (2.0 - 0.01) * CLIP / DEVICES
    assert float(difference.std()) == pytest.approx(expected, rel=0.02)
    assert abs(float(difference.mean())) < 4 * expected / len(difference) ** 0.5

    (metrics,) = [json.loads(line) for line in (tmp_path / "noisy" / "metrics.jsonl").read_text().splitlines()]
    assert sum(d["status"] == "accepted" for d in metrics["devices"].values()) == DEVICES
    # No device dropped: the sum carried the whole z C, and the ledger charged one round at z.
    assert metrics["privacy"]["noise_multiplier"] == pytest.approx(2.0)
    assert metrics["privacy"]["epsilon"] == pytest.approx(planned_epsilon(DEVICES, DEVICES, 1, 2.0, DELTA))
