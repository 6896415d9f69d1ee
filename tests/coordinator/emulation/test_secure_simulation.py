"""simulate() with secure aggregation: real agents mask their FedAvg updates, the coordinator unmasks only the sum."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from benchmarks.screening import OFF
from coordinator.emulation.simulation import SimClient, SimulationResult, simulate
from coordinator.strategies import ModelSpec, build_strategy
from device_agent.data.datasets import load_dataset
from device_agent.data.partition import PartitionSpec, client_shard
from device_agent.training.optimizer import TrainConfig

DEVICES = 5
SECURE = {"threshold": 3, "neighbours": 4, "clip": 0.5, "bits": 16}
HALF_STEP = SECURE["clip"] / (2 ** SECURE["bits"] - 1)
"""Half a quantization step of 2 clip / (2^bits - 1)."""
SIZES = [280, 250, 220, 190, 160]
"""Each device's training samples."""


def clients() -> list[SimClient]:
    data = load_dataset("digits", 8, 1)
    spec = PartitionSpec("iid", DEVICES, seed=0)
    shards = [client_shard(data.train_x, data.train_y, spec, i) for i in range(DEVICES)]
    test = client_shard(data.test_x, data.test_y, spec, 0)
    # Unequal shares: FedAvg weights each update by its samples, masked or not.
    return [SimClient(f"c{i}", 1.0, (x[: SIZES[i]], y[: SIZES[i]]), test) for i, (x, y) in enumerate(shards)]


def bound(survivors: list[int]) -> float:
    """The quantization error of the weighted mean, per value: each masked value is off by half a step at most,
    and the sum is divided by the survivors' weights (samples over the largest share)."""
    return len(survivors) * HALF_STEP / sum(SIZES[i] / max(SIZES) for i in survivors) + 1e-6


def run(run_dir: Path, secure: bool) -> SimulationResult:
    data = load_dataset("digits", 8, 1)
    return simulate(
        build_strategy("fedavg", ModelSpec("cnn", 10, 1, 8), {}, seed=0),
        clients(),
        2,
        TrainConfig(epochs=1, seed=0),
        (data.test_x, data.test_y),
        data.train_x[:128],
        limits=OFF,
        secure_aggregation=SECURE if secure else None,
        run_dir=run_dir,
    )


def largest_gap(plain: Path, secure: Path, round_: int) -> float:
    a, b = (load_file(d / "state" / f"round-{round_:06d}.safetensors") for d in (plain, secure))
    return max(float((a[k] - b[k]).abs().max()) for k in a if a[k].is_floating_point() and "running" not in k)


@pytest.mark.slow
def test_a_secure_fedavg_run_ends_where_the_plain_one_does_and_keeps_no_single_update(tmp_path: Path) -> None:
    plain = run(tmp_path / "plain", secure=False)
    secure = run(tmp_path / "secure", secure=True)

    assert [r.round for r in secure.rounds] == [1, 2] and not secure.failed_rounds
    # Round 1 starts from the same model: the secure weighted mean differs from the plain one by the quantization
    # alone (plus float32 rounding). Round 2 trains from models that differ by that much, and drifts a little further.
    assert largest_gap(tmp_path / "plain", tmp_path / "secure", 1) <= bound(list(range(DEVICES)))
    assert largest_gap(tmp_path / "plain", tmp_path / "secure", 2) < 1e-2
    assert secure.final.accuracy == pytest.approx(plain.final.accuracy, abs=0.02)

    # The run directory holds no device's update: nothing journaled or quarantined, only the global states.
    run_dir = tmp_path / "secure"
    files = sorted(p.relative_to(run_dir).as_posix() for p in run_dir.rglob("*") if p.is_file())
    assert [f for f in files if f.startswith(("journal", "quarantine"))] == []
    assert [f for f in files if f.endswith(".safetensors")] == [f"state/round-{r:06d}.safetensors" for r in (0, 1, 2)]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [sum(d["status"] == "accepted" for d in m["devices"].values()) for m in metrics] == [DEVICES, DEVICES]
    assert all(d["payload_bytes"] == 0 for m in metrics for d in m["devices"].values())
    # The protocol's line: everyone survived, and no update value was clamped to the quantization range.
    assert [(m["secure"]["survivors"], m["secure"]["dropped"]) for m in metrics] == [(DEVICES, 0), (DEVICES, 0)]
    assert [m["secure"]["clamped_fraction"] for m in metrics] == [0.0, 0.0]


@pytest.mark.slow
def test_a_device_whose_training_fails_drops_out_and_the_others_sum_still_closes_the_round(tmp_path: Path) -> None:
    data = load_dataset("digits", 8, 1)
    fleet = clients()
    x, y = fleet[4].train
    fleet[4] = SimClient("c4", 1.0, (x, torch.full_like(y, 99)), fleet[4].test)  # labels past the classes: fails
    runs = {}
    for secure in (False, True):
        run_dir = tmp_path / ("secure" if secure else "plain")
        runs[secure] = simulate(
            build_strategy("fedavg", ModelSpec("cnn", 10, 1, 8), {}, seed=0),
            fleet,
            1,
            TrainConfig(epochs=1, seed=0),
            (data.test_x, data.test_y),
            data.train_x[:128],
            limits=OFF,
            quorum=0.8,
            secure_aggregation=SECURE if secure else None,
            run_dir=run_dir,
        )

    assert not runs[True].failed_rounds
    (metrics,) = [json.loads(line) for line in (tmp_path / "secure" / "metrics.jsonl").read_text().splitlines()]
    assert {d: m["status"] for d, m in metrics["devices"].items()} == {
        **{f"c{i}": "accepted" for i in range(4)},
        "c4": "failed",
    }
    # c4 advertised keys and shared them, then dropped: its masks were removed with its neighbours' shares.
    assert largest_gap(tmp_path / "plain", tmp_path / "secure", 1) <= bound([0, 1, 2, 3])
