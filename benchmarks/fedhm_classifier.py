"""FedHM's label-masked classifier rules side by side: off, reference, renormalised.

    python -m benchmarks.fedhm_classifier --dataset digits --seeds 2 [--json]

compare's hetero-devices scenario (four rank tiers 1, 1/2, 1/4, 1/8, Dirichlet 0.5 and 0.1),
FedHM only, one run per rule, seed and split, with compare's training settings (batch 32,
lr 0.05); global and personalized accuracy, mean and std over seeds. The measurement behind
the ``label_masked_classifier`` default (docs/presets.md).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from benchmarks.compare import ARCH, levels_for, scenarios
from benchmarks.stats import mean_std
from coordinator.algorithms.aggregation import ClassifierRule
from coordinator.emulation.simulation import SimClient, simulate
from coordinator.strategies import ModelSpec, build_strategy
from coordinator.strategies.levels import RANK
from device_agent.data.datasets import LabeledData, load_dataset
from device_agent.data.partition import PartitionSpec, client_shard
from device_agent.training.optimizer import TrainConfig


def run_rule(rule: str, partition: PartitionSpec, data: LabeledData, rounds: int, train: TrainConfig) -> dict:
    levels = levels_for(RANK, partition.num_clients, True, data)
    clients = [
        SimClient(
            f"client-{i}",
            levels[i],
            client_shard(data.train_x, data.train_y, partition, i, data.num_classes),
            client_shard(data.test_x, data.test_y, partition, i, data.num_classes),
        )
        for i in range(partition.num_clients)
    ]
    model = ModelSpec(ARCH, data.num_classes, data.in_channels, data.image_size)
    strategy = build_strategy("fedhm", model, {"label_masked_classifier": rule}, partition.seed)
    torch.manual_seed(partition.seed)
    result = simulate(strategy, clients, rounds, train, (data.test_x, data.test_y), data.train_x[:256])
    return {"accuracy": result.final.accuracy, "personalized_accuracy": result.final.personalized_accuracy}


def measure(data: LabeledData, rounds: int, seeds: int, clients: int, train: TrainConfig) -> dict:
    runs: dict[str, dict[str, dict[str, list[float]]]] = {}
    for seed in range(seeds):
        for setting in scenarios(clients, seed)["hetero-devices"]:
            for rule in ClassifierRule:
                row = run_rule(rule.value, setting.partition, data, rounds, train)
                cell = runs.setdefault(setting.label, {}).setdefault(rule.value, {"global": [], "personalized": []})
                cell["global"].append(row["accuracy"])
                cell["personalized"].append(row["personalized_accuracy"])
                print(f"{setting.label} seed {seed} {rule.value}: {row}", file=sys.stderr, flush=True)
    return {
        label: {rule: {metric: mean_std(values) for metric, values in cell.items()} for rule, cell in by_rule.items()}
        for label, by_rule in runs.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fedhm_classifier", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="digits", help="digits or a path load_dataset reads (default: digits)")
    parser.add_argument("--image-size", type=int, default=8, help="side the images are resized to (default: 8)")
    parser.add_argument("--rounds", type=int, default=10, help="federated rounds (default: 10)")
    parser.add_argument("--seeds", type=int, default=2, help="seeds 0..K-1 (default: 2)")
    parser.add_argument("--clients", type=int, default=8, help="number of clients (default: 8)")
    parser.add_argument("--epochs", type=int, default=1, help="local epochs per round (default: 1)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    data = load_dataset(args.dataset, args.image_size, 1)
    torch.set_num_threads(1)
    train = TrainConfig(epochs=args.epochs, batch_size=32, lr=0.05)
    results = measure(data, args.rounds, args.seeds, args.clients, train)
    if args.json:
        print(json.dumps({"benchmark": "fedhm_classifier", "dataset": str(args.dataset), "results": results}))
        return 0
    for label, by_rule in results.items():
        for rule, cell in by_rule.items():
            g, p = cell["global"], cell["personalized"]
            print(
                f"{label:14} {rule:13} global {g['mean']:.3f} +- {g['std']:.3f}   "
                f"personalized {p['mean']:.3f} +- {p['std']:.3f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
