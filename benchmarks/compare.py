"""Every registered strategy side by side on digits, in one process (no broker).

    python -m benchmarks.compare --scenario hetero-devices [--json] [--rounds N] [--seeds K]

Scenarios (8 clients by default):
- hetero-devices: four device tiers (two clients each) at matched parameter budgets - FedHM
  rank ratios 1, 1/2, 1/4, 1/8 and, for width strategies, the width whose dense model has the
  same trainable parameters as the FedHM hybrid; Dirichlet 0.5 and 0.1 label splits;
- permuted-labels: every client its own label permutation (seed + client id), IID and Dirichlet 0.5;
- domains: two disjoint class groups (digits 0-4 and 5-9), four clients each;
- fedlora: a ViT pre-trained on digits 0-4 fine-tuned on 5-9 under Dirichlet(0.01): ft, lora_r2 ...
  lora_r16 and fedlora, with the paper's claims checked (``benchmarks.fedlora``).
Strategies with no size levels train the full model on every device. The fine-tuning strategies
(ft, lora_homogeneous, fedlora) start from a pre-trained ViT, which the digits CNN trained from
scratch is not: the first three scenarios skip them with a note, the fedlora scenario runs them.
Global accuracy under permuted labels is near chance by construction (no shared label space); read
the personalized column.

Defaults are sized for 2 shared CPU cores: scikit-learn digits (8x8, 1797 images, 20 % held out)
and the 0.1 M-parameter small CNN, whose FedHM hybrid factorizes conv2 and conv3; a scaled
ResNet would spend minutes per round on the same data without changing what is compared.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

from benchmarks import fedlora
from coordinator.emulation.simulation import SimClient, simulate
from coordinator.strategies import STRATEGIES, ModelSpec, build_strategy
from coordinator.strategies.fedlora import FineTune
from device_agent.data.datasets import LabeledData, load_dataset
from device_agent.data.partition import PartitionSpec, client_shard
from device_agent.layers.hybrid import hybrid
from device_agent.models import build_model
from device_agent.training.optimizer import TrainConfig

ARCH = "cnn"
SCENARIOS = ("hetero-devices", "permuted-labels", "domains")
RANKS = (1.0, 0.5, 0.25, 0.125)


@dataclass(frozen=True)
class Setting:
    label: str
    partition: PartitionSpec
    tiered: bool = False


@dataclass
class Cell:
    accuracy: list[float] = field(default_factory=list)
    personalized: list[float] = field(default_factory=list)
    upload: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)


def scenarios(num_clients: int, seed: int) -> dict[str, list[Setting]]:
    return {
        "hetero-devices": [
            Setting("dirichlet-0.5", PartitionSpec("dirichlet", num_clients, seed, alpha=0.5), tiered=True),
            Setting("dirichlet-0.1", PartitionSpec("dirichlet", num_clients, seed, alpha=0.1), tiered=True),
        ],
        "permuted-labels": [
            Setting("iid", PartitionSpec("iid", num_clients, seed, permute_labels=True)),
            Setting("dirichlet-0.5", PartitionSpec("dirichlet", num_clients, seed, alpha=0.5, permute_labels=True)),
        ],
        "domains": [Setting("2-domains", PartitionSpec("domains", num_clients, seed, num_domains=2))],
    }


def fine_tuning(strategies: list[str]) -> list[str]:
    """Those of ``strategies`` that fine-tune a pre-trained ViT (LoRA adapters or all of it): not for the CNN."""
    return [name for name in strategies if issubclass(STRATEGIES[name], FineTune)]


def trainable_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def matched_width(gamma: float, num_classes: int, in_channels: int) -> float:
    """The width whose dense model has (just) no fewer parameters than the FedHM hybrid at ``gamma``."""
    with torch.device("meta"):
        target = trainable_params(hybrid(ARCH, gamma, num_classes, in_channels))
        low, high = 0.01, 1.0
        for _ in range(30):
            middle = (low + high) / 2
            if trainable_params(build_model(ARCH, num_classes, in_channels, width=middle)) >= target:
                high = middle
            else:
                low = middle
    return round(high, 3)


def levels_for(kind: str, num_clients: int, tiered: bool, data: LabeledData) -> list[float]:
    if not tiered or kind == "none":
        return [1.0] * num_clients
    tiers = list(RANKS) if kind == "rank" else [matched_width(g, data.num_classes, data.in_channels) for g in RANKS]
    return [tiers[i * len(tiers) // num_clients] for i in range(num_clients)]


def run_setting(name: str, setting: Setting, data: LabeledData, rounds: int, train: TrainConfig) -> dict:
    spec = setting.partition
    cls = STRATEGIES[name]
    levels = levels_for(cls.levels, spec.num_clients, setting.tiered, data)
    clients = [
        SimClient(
            f"client-{i}",
            levels[i],
            client_shard(data.train_x, data.train_y, spec, i, data.num_classes),
            client_shard(data.test_x, data.test_y, spec, i, data.num_classes),
        )
        for i in range(spec.num_clients)
    ]
    model = ModelSpec(ARCH, data.num_classes, data.in_channels, data.image_size)
    strategy = build_strategy(name, model, {}, spec.seed)
    torch.manual_seed(spec.seed)
    start = time.perf_counter()
    result = simulate(strategy, clients, rounds, train, (data.test_x, data.test_y), data.train_x[:256])
    return {
        "accuracy": result.final.accuracy,
        "personalized_accuracy": result.final.personalized_accuracy,
        "upload_bytes_per_round": result.upload_bytes_per_round,
        "seconds": time.perf_counter() - start,
    }


def mean_std(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "std": statistics.pstdev(values) if len(values) > 1 else 0.0}


def compare(names: list[str], rounds: int, seeds: int, clients: int, train: TrainConfig, strategies: list[str]) -> dict:
    data = load_dataset("digits", 8, 1)
    out: dict[str, dict] = {}
    for scenario in names:
        cells: dict[str, dict[str, Cell]] = {}
        for seed in range(seeds):
            for setting in scenarios(clients, seed)[scenario]:
                for name in strategies:
                    row = run_setting(name, setting, data, rounds, train)
                    cell = cells.setdefault(setting.label, {}).setdefault(name, Cell())
                    cell.accuracy.append(row["accuracy"])
                    cell.personalized.append(row["personalized_accuracy"])
                    cell.upload.append(row["upload_bytes_per_round"])
                    cell.seconds.append(row["seconds"])
        for label, by_strategy in cells.items():
            out[f"{scenario}/{label}"] = {
                name: {
                    "accuracy": mean_std(c.accuracy),
                    "personalized_accuracy": mean_std(c.personalized),
                    "upload_bytes_per_round": statistics.fmean(c.upload),
                    "wall_seconds": statistics.fmean(c.seconds),
                }
                for name, c in by_strategy.items()
            }
    return out


def print_tables(results: dict, rounds: int, seeds: int) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for scenario, rows in results.items():
        table = Table(title=f"{scenario}: digits, {rounds} rounds, {seeds} seed(s), mean +- std")
        for column in ("strategy", "global acc", "personalized acc", "upload / client / round", "wall s"):
            table.add_column(column, justify="left" if column == "strategy" else "right")
        for name, row in rows.items():
            acc, pers = row["accuracy"], row["personalized_accuracy"]
            table.add_row(
                name,
                f"{acc['mean']:.3f} +- {acc['std']:.3f}",
                f"{pers['mean']:.3f} +- {pers['std']:.3f}",
                f"{row['upload_bytes_per_round'] / 1024:.1f} KiB",
                f"{row['wall_seconds']:.1f}",
            )
        console.print(table)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.compare",
        description="Run every registered strategy side by side on digits (in-process clients, no broker).",
    )
    parser.add_argument(
        "--scenario",
        required=True,
        choices=[*SCENARIOS, "fedlora", "all"],
        help="hetero-devices, permuted-labels, domains, all (those three), or fedlora",
    )
    parser.add_argument("--rounds", type=int, default=10, help="federated rounds (default: 10)")
    parser.add_argument("--seeds", type=int, default=1, help="seeds 0..K-1 to average over (default: 1)")
    parser.add_argument("--clients", type=int, default=8, help="number of clients (default: 8)")
    parser.add_argument("--epochs", type=int, default=1, help="local epochs per round (default: 1)")
    parser.add_argument(
        "--strategies",
        help=f"comma-separated subset (default: every registered one the scenario applies to: {', '.join(STRATEGIES)})",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for flag in ("rounds", "seeds", "clients", "epochs"):
        if getattr(args, flag) < 1:
            print(f"--{flag} must be >= 1", file=sys.stderr)
            return 2
    if args.clients < 2:
        print("--clients must be >= 2 (the domains scenario has two domains)", file=sys.stderr)
        return 2
    names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    strategies = list(STRATEGIES) if args.strategies is None else [s.strip() for s in args.strategies.split(",")]
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        print(f"unknown strategies: {', '.join(unknown)}; known: {', '.join(STRATEGIES)}", file=sys.stderr)
        return 2
    pretrained = fine_tuning(strategies) if args.scenario != "fedlora" else []
    why = "fine-tuning strategies start from a pre-trained ViT, not the digits CNN (run them with --scenario fedlora)"
    if pretrained and args.strategies is not None:
        print(f"--strategies {', '.join(pretrained)}: {why}", file=sys.stderr)
        return 2
    if pretrained:
        print(f"skipped {', '.join(pretrained)}: {why}", file=sys.stderr)
        strategies = [s for s in strategies if s not in pretrained]
    torch.set_num_threads(1)
    if args.scenario == "fedlora":
        entries = fedlora.run(args.rounds, args.seeds, args.clients, args.epochs)
        report = {"fedlora/dirichlet-0.01": entries, "checks": fedlora.checks(entries)}
        print(json.dumps(report, indent=2) if args.json else fedlora.table(report))
        return 0
    train = TrainConfig(epochs=args.epochs, batch_size=32, lr=0.05)
    results = compare(names, args.rounds, args.seeds, args.clients, train, strategies)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print_tables(results, args.rounds, args.seeds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
