"""simulate() with secure aggregation beyond FedAvg: HeteroFL and FedRolex width slices, FedHM's dense updates,
FedAvgSmall's one narrow model.

Real agents over the in-memory transport, levels 1, 1, 1/2, 1/2, 1/4: each device masks its contribution in the
layout the coordinator sent with its setup (a width slice padded into the full model with a count per value of the
label-masked classifier; FedHM's low-rank layers rebuilt dense), and the round closes on the unmasked sum only.
After one round the global model is the plain run's within the quantization error.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from safetensors.torch import load_file

from benchmarks.screening import OFF
from coordinator.emulation.simulation import SimClient, simulate
from coordinator.strategies import ModelSpec, build_strategy
from device_agent.data.datasets import load_dataset
from device_agent.data.partition import PartitionSpec, client_shard
from device_agent.training.optimizer import TrainConfig

LEVELS = [1.0, 1.0, 0.5, 0.5, 0.25]
SECURE = {"threshold": 3, "neighbours": 4, "clip": 0.5, "bits": 16}
HALF_STEP = SECURE["clip"] / (2 ** SECURE["bits"] - 1)


def clients() -> list[SimClient]:
    data = load_dataset("digits", 8, 1)
    spec = PartitionSpec("dirichlet", len(LEVELS), seed=0, alpha=0.1)  # skewed labels: the classifier's counts differ
    shards = [client_shard(data.train_x, data.train_y, spec, i) for i in range(len(LEVELS))]
    test = client_shard(data.test_x, data.test_y, spec, 0)
    return [SimClient(f"c{i}", level, shard, test) for i, (level, shard) in enumerate(zip(LEVELS, shards, strict=True))]


def run(name: str, run_dir: Path, secure: bool) -> None:
    data = load_dataset("digits", 8, 1)
    simulate(
        build_strategy(name, ModelSpec("cnn", 10, 1, 8), {}, seed=0),
        clients(),
        1,
        TrainConfig(epochs=1, seed=0),
        (data.test_x, data.test_y),
        data.train_x[:128],
        limits=OFF,
        secure_aggregation=SECURE if secure else None,
        run_dir=run_dir,
    )


def largest_gap(plain: Path, secure: Path) -> float:
    a, b = (load_file(d / "state" / "round-000001.safetensors") for d in (plain, secure))
    return max(float((a[k] - b[k]).abs().max()) for k in a if a[k].is_floating_point() and "running" not in k)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["heterofl", "fedrolex", "fedhm", "fedavg_small"])
def test_a_secure_round_of_a_sum_strategy_ends_where_the_plain_one_does(name: str, tmp_path: Path) -> None:
    run(name, tmp_path / "plain", secure=False)
    run(name, tmp_path / "secure", secure=True)

    # Each device's weighted value is off by half a step at most, and the sum is divided by the holders' weights:
    # HeteroFL and FedRolex weigh each holder 1 (padded zeros are taken off exactly, and the label-masked
    # classifier's holder counts come out as integers); FedHM weighs device i by exp(gamma_i - 1) (its paper
    # softmax, scaled to the largest), so its bound is 5 half steps over the sum of those weights.
    # FedAvgSmall: every device trains the narrowest model, weighted by its samples over the largest share.
    weights = {
        "fedhm": [math.exp(level - 1) for level in LEVELS],
        "fedavg_small": [len(c.train[1]) / max(len(d.train[1]) for d in clients()) for c in clients()],
    }.get(name, [1.0] * len(LEVELS))
    bound = len(LEVELS) * HALF_STEP / sum(weights) if name in ("fedhm", "fedavg_small") else HALF_STEP
    assert largest_gap(tmp_path / "plain", tmp_path / "secure") <= bound + 1e-6
    metrics = [json.loads(line) for line in (tmp_path / "secure" / "metrics.jsonl").read_text().splitlines()]
    assert {d: m["status"] for d, m in metrics[0]["devices"].items()} == {f"c{i}": "accepted" for i in range(5)}
    assert not any((tmp_path / "secure").rglob("journal/**/*.safetensors"))
