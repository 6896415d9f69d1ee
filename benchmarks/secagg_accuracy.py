"""Does secure aggregation cost accuracy? FedAvg and FedHM on Fashion-MNIST twice per seed over the round engine
(``simulate()``, real agents over the in-memory transport): plain, and under fleet.yaml ``secure_aggregation``
(SecAgg+, 16-bit fixed point, the graph's suggested threshold and degree), same seed, same shards.

    python -m benchmarks.secagg_accuracy [--json] [--strategies fedavg,fedhm] [--devices 10] [--rounds 5] [--seeds 3]
        [--clip 0.5] [--bits 16]

Under secure aggregation each device masks its update (FedHM: its low-rank layers rebuilt dense, weighted by its
public softmax weight) and the coordinator folds only the unmasked sum, so the accuracy gap is what quantization
and the clip range do. FedHM's devices take levels 1, 1/2, 1/4 in turn. Both runs have the upload gate's screening
off (``benchmarks.screening.OFF``): under SecAgg the coordinator cannot screen.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.compare import load_data
from benchmarks.machine import describe
from benchmarks.output import print_result
from benchmarks.screening import OFF
from benchmarks.stats import over_seeds
from coordinator.emulation.simulation import SimClient, simulate
from coordinator.run.rundir import read_metrics
from coordinator.strategies import ModelSpec, build_strategy
from device_agent.clients.base import is_norm_statistic
from device_agent.data.datasets import LabeledData
from device_agent.data.partition import PartitionSpec, client_shard
from device_agent.secagg.graph import suggested
from device_agent.training.optimizer import TrainConfig

ARCH = "cnn28"
LEVELS = {"fedavg": (1.0,), "fedhm": (1.0, 0.5, 0.25)}
"""The levels devices take in turn, per strategy."""


def run(
    name: str, secure: bool, args: argparse.Namespace, data: LabeledData, seed: int
) -> tuple[dict, dict[str, torch.Tensor]]:
    """The run's accuracy per round (and clamped fraction), and the final global trainable weights."""
    torch.set_num_threads(1)
    spec = PartitionSpec("iid", args.devices, seed=seed)
    levels = LEVELS[name]
    clients = [
        SimClient(
            f"d{i:03d}",
            levels[i % len(levels)],
            client_shard(data.train_x, data.train_y, spec, i, data.num_classes),
            client_shard(data.test_x, data.test_y, spec, i, data.num_classes),
        )
        for i in range(args.devices)
    ]
    model = ModelSpec(ARCH, data.num_classes, data.in_channels, data.image_size)
    strategy = build_strategy(name, model, {}, seed=seed)
    threshold, neighbours = suggested(args.devices)
    settings = {"threshold": threshold, "neighbours": neighbours, "clip": args.clip, "bits": args.bits}
    train = TrainConfig(lr=args.lr, epochs=args.epochs, batch_size=16, seed=seed)
    torch.manual_seed(seed)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="secagg-accuracy-") as tmp:
        result = simulate(
            strategy,
            clients,
            args.rounds,
            train,
            (data.test_x, data.test_y),
            data.train_x[:256],
            limits=OFF,
            secure_aggregation=settings if secure else None,
            run_dir=Path(tmp) / "run",
        )
        metrics = read_metrics(Path(tmp) / "run" / "metrics.jsonl")
    out: dict = {
        "accuracy": [round(r.accuracy, 4) for r in result.rounds],
        "seconds": round(time.perf_counter() - started, 1),
    }
    if secure:
        out["clamped_fraction"] = max(m.secure.clamped_fraction for m in metrics if m.secure is not None)
        out["survivors"] = [m.secure.survivors for m in metrics if m.secure is not None]
    # BatchNorm statistics are recomputed after aggregation, not averaged: left out of the comparison.
    weights = {k: v for k, v in strategy.global_state().items() if v.is_floating_point() and not is_norm_statistic(k)}
    return out, weights


def compare_seed(name: str, seed: int, args: argparse.Namespace, data: LabeledData) -> dict:
    """Plain and secure runs from one seed: accuracies per round, and how far the final weights drifted apart."""
    (plain, plain_weights), (secure, secure_weights) = (
        run(name, False, args, data, seed),
        run(name, True, args, data, seed),
    )
    difference = torch.cat([(secure_weights[k] - plain_weights[k]).double().reshape(-1) for k in plain_weights])
    reference = torch.cat([value.double().reshape(-1) for value in plain_weights.values()])
    return {
        "strategy": name,
        "seed": seed,
        "plain": plain,
        "secure": secure,
        "gap_points": round(100 * (plain["accuracy"][-1] - secure["accuracy"][-1]), 2),
        "weights_max_abs_difference": float(difference.abs().max()),
        "weights_relative_difference": float(difference.norm() / reference.norm()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--strategies", default="fedavg,fedhm", help=f"comma-separated, of {', '.join(LEVELS)}")
    parser.add_argument("--devices", type=int, default=10)
    parser.add_argument("--samples-per-device", type=int, default=200)
    parser.add_argument("--test-samples", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--clip", type=float, default=0.5, help="quantization range [-clip, clip] of an update")
    parser.add_argument("--bits", type=int, default=16)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args(argv)
    names = [name for name in args.strategies.split(",") if name]
    unknown = sorted(set(names) - set(LEVELS))
    if unknown:
        parser.error(f"--strategies: {', '.join(unknown)} not measured here (choose from {', '.join(LEVELS)})")
    data = load_data("fashion_mnist", args.devices * args.samples_per_device, args.test_samples)
    result: dict = {
        "benchmark": "secagg_accuracy",
        "dataset": "fashion_mnist",
        "arch": ARCH,
        "devices": args.devices,
        "rounds": args.rounds,
        "seeds": args.seeds,
        "clip": args.clip,
        "bits": args.bits,
    }
    runs = []
    for name in names:
        rows = [compare_seed(name, seed, args, data) for seed in range(args.seeds)]
        runs += rows
        final = over_seeds({mode: [row[mode]["accuracy"][-1] for row in rows] for mode in ("plain", "secure")})
        plain, secure = final["plain"]["mean"], final["secure"]["mean"]
        result[f"{name}_plain_accuracy"] = round(plain, 4)
        result[f"{name}_secure_accuracy"] = round(secure, 4)
        result[f"{name}_gap_points"] = round(100 * (plain - secure), 2)
        # The seed-to-seed spread of the plain runs: how much a run's accuracy moves for reasons other than SecAgg.
        std = round(100 * final["plain"]["std"], 2) if len(rows) > 1 else None
        result[f"{name}_plain_seed_std_points"] = std
        result[f"{name}_final_accuracy_over_seeds"] = final
    result["clamped_fraction"] = max(row["secure"]["clamped_fraction"] for row in runs)
    result["runs"] = runs
    result["provenance"] = describe()
    print_result(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
