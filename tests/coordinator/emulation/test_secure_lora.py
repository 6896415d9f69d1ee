"""simulate() with secure aggregation of LoRA fine-tuning: FedIT (lora_homogeneous), HetLoRA's zero-padded factors,
fedlora's dense products, and full fine-tuning (ft).

Real agents over the in-memory transport train a ViT on digits; each device masks its upload in the layout the
coordinator sent with its setup (HetLoRA: A and B zero-padded to the largest rank, B in effective form), and the
round closes on the unmasked sum only. After one round the global adapters (and head) are the plain run's within
the quantization error: each device's weighted value is off by at most half a step, and the sum is divided by the
survivors' weights.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from safetensors.torch import load_file

from benchmarks.screening import OFF
from coordinator.config.fleet import FleetError
from coordinator.emulation.simulation import SimClient, simulate
from coordinator.strategies import ModelSpec, build_strategy
from device_agent.data.datasets import load_dataset
from device_agent.data.partition import PartitionSpec, client_shard
from device_agent.training.optimizer import TrainConfig

HETEROGENEOUS = [1.0, 1.0, 0.5, 0.5, 0.25]  # ranks 16, 16, 8, 8, 4 (max_rank 16)
SECURE = {"threshold": 3, "neighbours": 4, "clip": 0.5, "bits": 16}
HALF_STEP = SECURE["clip"] / (2 ** SECURE["bits"] - 1)
VIT = ModelSpec("vit_tiny", 10, 1, 8)
CASES = {  # strategy: (params, levels)
    "hetlora": ({"weighting": "samples"}, HETEROGENEOUS),
    "fedlora": ({}, HETEROGENEOUS),
    "lora_homogeneous": ({}, [1.0] * 5),
    "ft": ({}, [1.0] * 5),
}


def clients(levels: list[float]) -> list[SimClient]:
    data = load_dataset("digits", 8, 1)
    spec = PartitionSpec("dirichlet", len(levels), seed=0, alpha=0.1)  # skewed: the devices' sample counts differ
    shards = [client_shard(data.train_x, data.train_y, spec, i) for i in range(len(levels))]
    test = client_shard(data.test_x, data.test_y, spec, 0)
    return [SimClient(f"c{i}", level, shard, test) for i, (level, shard) in enumerate(zip(levels, shards, strict=True))]


def run(name: str, run_dir: Path, secure: bool, params: dict | None = None) -> None:
    data = load_dataset("digits", 8, 1)
    own, levels = CASES[name]
    simulate(
        build_strategy(name, VIT, own if params is None else params, seed=0),
        clients(levels),
        1,
        TrainConfig(epochs=1, seed=0),
        (data.test_x, data.test_y),
        data.train_x[:128],
        limits=OFF,
        secure_aggregation=SECURE if secure else None,
        run_dir=run_dir,
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_a_secure_lora_round_ends_where_the_plain_one_does(name: str, tmp_path: Path) -> None:
    run(name, tmp_path / "plain", secure=False)
    run(name, tmp_path / "secure", secure=True)

    plain, secure = (
        load_file(d / "state" / "round-000001.safetensors") for d in (tmp_path / "plain", tmp_path / "secure")
    )
    assert plain.keys() == secure.keys()
    gap = max(float((plain[k] - secure[k]).abs().max()) for k in plain if plain[k].is_floating_point())
    # fedlora weighs device i by exp(level_i - 1) (its paper softmax over the largest); the others by samples over
    # the largest share. The padded zeros of HetLoRA's smaller ranks are taken off exactly.
    _, levels = CASES[name]
    samples = [len(c.train[1]) for c in clients(levels)]
    weights = [math.exp(v - 1) for v in levels] if name == "fedlora" else [n / max(samples) for n in samples]
    assert gap <= len(levels) * HALF_STEP / sum(weights) + 1e-6
    assert gap > 0  # the secure run really went through the quantized protocol
    metrics = [json.loads(line) for line in (tmp_path / "secure" / "metrics.jsonl").read_text().splitlines()]
    assert {d: m["status"] for d, m in metrics[0]["devices"].items()} == {f"c{i}": "accepted" for i in range(5)}
    assert not any((tmp_path / "secure").rglob("journal/**/*.safetensors"))


@pytest.mark.parametrize(
    ("name", "params", "said"),
    [
        ("hetlora", {}, "strategy.params.weighting: 'sparsity' weighs each device by"),
        ("flora", {}, "stacking puts each device's factors in its own block"),
    ],
)
def test_lora_rules_that_read_one_device_are_refused_with_their_reason(
    name: str, params: dict, said: str, tmp_path: Path
) -> None:
    data = load_dataset("digits", 8, 1)
    with pytest.raises(FleetError, match=said):
        simulate(
            build_strategy(name, VIT, params, seed=0),
            clients(HETEROGENEOUS),
            1,
            TrainConfig(epochs=1, seed=0),
            (data.test_x, data.test_y),
            data.train_x[:128],
            limits=OFF,
            secure_aggregation=SECURE,
            run_dir=tmp_path,
        )
