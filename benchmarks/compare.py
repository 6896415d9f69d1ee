"""Every registered strategy side by side on digits or Fashion-MNIST, in-process clients (no broker).

    python -m benchmarks.compare --scenario hetero-devices [--dataset fashion_mnist] [--json] [--rounds N] [--seeds K]
    python -m benchmarks.compare --scenario all --dataset fashion_mnist --seeds 3 --jobs 16   (one core per job)

Scenarios (8 clients by default):
- hetero-devices: four device tiers (two clients each) at matched parameter budgets - FedHM
  rank ratios 1, 1/2, 1/4, 1/8 and, for width strategies, the width whose dense model has the
  same trainable parameters as the FedHM hybrid; Dirichlet 0.5 and 0.1 label splits;
- permuted-labels: every client its own label permutation (seed + client id), IID and Dirichlet 0.5;
- domains: two disjoint class groups (classes 0-4 and 5-9), four clients each;
- large-fleet: 50 clients, Dirichlet 0.5, device tiers as hetero-devices, 20 % of the clients asked per round;
- fedlora: a ViT pre-trained on Fashion-MNIST classes 0-4 (cached) fine-tuned on 5-9 under
  Dirichlet(0.1), 50 clients, all of them every round, 20 rounds: ft, lora_r2 ... lora_r16, fedlora, hetlora and
  flora, with the paper's claims checked (``benchmarks.fedlora``); ``--strategies`` picks among them by
  strategy name.
Strategies with no size levels train the full model on every device. The fine-tuning strategies
(ft, lora_homogeneous, fedlora, hetlora, flora) start from a pre-trained ViT, which the CNN trained from
scratch is not: the first three scenarios skip them with a note, the fedlora scenario runs them.
Global accuracy under permuted labels is near chance by construction (no shared label space); read
the personalized column. Every strategy shows both accuracies; the one its paper reports is marked
(*), and the papers' claims are checked as PASS/TIE/FAIL lines (``claims``).

A strategy's score in one run is the mean of its last :data:`benchmarks.stats.LAST_ROUNDS` rounds (one round's class mix
decides less), and a claim is judged on the paired differences of the scores seed by seed (both strategies
see the same split and initialization per seed): PASS when the 95 % confidence interval of the mean
difference (Student's t) lies above zero, TIE when it straddles zero, FAIL when it lies below. Every seed's
score is in the JSON (``seeds``). Seeds spread by 0.08-0.20 here, so separating methods takes >= 5.

Fashion-MNIST (``--dataset fashion_mnist``, Debian's dataset-fashion-mnist) is subsampled per run:
``--train-samples`` images drawn once (seed 0) from the 60,000, ``--test-samples`` from the 10,000,
and trained on ``cnn28`` (the small CNN pooled after its first conv too), so that every strategy, scenario
and seed fits 2 shared cores: ``--scenario all --seeds 3 --jobs 2`` is 162 cells, about 2.5 h here
(``--cache FILE`` resumes a stopped run).

Strategies run with the upload gate's screening off (``benchmarks.screening``: no update bound, no peer
check), so that honest non-IID updates are neither clipped nor refused and the figures measure the
methods; ``--screening`` keeps fleet.yaml's defaults. Each strategy's ``failed_rounds`` (summed over seeds,
a round that lost an update under the simulation's quorum of every client) is in the JSON.

Defaults are sized for 2 shared CPU cores: scikit-learn digits (8x8, 1797 images, 20 % held out)
and the 0.1 M-parameter small CNN, whose FedHM hybrid factorizes conv2 and conv3; a scaled
ResNet would spend minutes per round on the same data without changing what is compared.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import sys
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from benchmarks import fedlora, screening
from benchmarks.cell_cache import CacheMismatch, CellCache
from benchmarks.machine import describe
from benchmarks.stats import (
    CONFIDENCE,
    interval_of,
    last_rounds_mean,
    over_seeds,
    paired_interval,
    verdict,
)
from coordinator.emulation.simulation import SimClient, simulate
from coordinator.strategies import STRATEGIES, ModelSpec, build_strategy
from coordinator.strategies.fedlora import FineTune
from coordinator.strategies.levels import RANK, LevelScale
from device_agent.data.datasets import FASHION_MNIST, DatasetError, LabeledData, load_dataset
from device_agent.data.partition import PartitionSpec, client_shard
from device_agent.layers.hybrid import hybrid
from device_agent.models import build_model
from device_agent.training.optimizer import TrainConfig

ARCH = "cnn"
ARCHS = ("cnn", "cnn28", "resnet9")
"""``--arch resnet9``: a small ResNet, where factorized convolutions carry the model."""
DEFAULT_ARCH = {"digits": ARCH, FASHION_MNIST: "cnn28"}
"""The small CNN; at 28x28 pooled after its first conv as well, which makes a Fashion-MNIST cell 2.8x cheaper."""
SCENARIOS = ("hetero-devices", "permuted-labels", "domains", "large-fleet")
LARGE_FLEET, LARGE_FLEET_PARTICIPATION = 50, 0.2
# The accuracy each strategy's paper reports: the global model's, or each client's on its own distribution.
PAPER_METRIC = {
    "fedhm": "accuracy",
    "fedavg": "accuracy",
    "fedavg_small": "accuracy",
    "heterofl": "accuracy",
    "fedrolex": "accuracy",
    "factorized_fl": "personalized_accuracy",
    "factorized_fl_beta": "personalized_accuracy",
    "simfed": "personalized_accuracy",
    "simfed_paper": "personalized_accuracy",
    "fedfac": "personalized_accuracy",
}
RANKS = (1.0, 0.5, 0.25, 0.125)
PRESETS: dict[str, tuple[str, dict[str, object]]] = {"simfed_paper": ("simfed", {"tau": 0.9, "alpha": 30.0})}
"""A strategy at its paper's settings, run beside the same strategy at fedfleet's defaults; the paper's claims
are judged at the paper's settings (SimFed: tau 0.9, alpha 30; fedfleet's defaults are tau 0, alpha 1)."""


@dataclass(frozen=True)
class Setting:
    label: str
    partition: PartitionSpec
    tiered: bool = False
    participation: float = 1.0


@dataclass
class Cell:
    accuracy: list[float] = field(default_factory=list)
    final: list[float] = field(default_factory=list)
    personalized: list[float] = field(default_factory=list)
    upload: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    failed_rounds: int = 0


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
        "large-fleet": [
            Setting(
                f"{LARGE_FLEET}-clients-dirichlet-0.5",
                PartitionSpec("dirichlet", LARGE_FLEET, seed, alpha=0.5),
                tiered=True,
                participation=LARGE_FLEET_PARTICIPATION,
            )
        ],
    }


def strategy_of(name: str) -> tuple[str, dict[str, object]]:
    """The registered strategy and the parameters a compared name runs with (a preset's, else the defaults)."""
    return PRESETS.get(name, (name, {}))


def fine_tuning(strategies: list[str]) -> list[str]:
    """Those of ``strategies`` that fine-tune a pre-trained ViT (LoRA adapters or all of it): not for the CNN."""
    return [name for name in strategies if issubclass(STRATEGIES[strategy_of(name)[0]], FineTune)]


def trainable_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def matched_width(gamma: float, num_classes: int, in_channels: int, arch: str = ARCH) -> float:
    """The width whose dense model has (just) no fewer parameters than the FedHM hybrid at ``gamma``."""
    with torch.device("meta"):
        target = trainable_params(hybrid(arch, gamma, num_classes, in_channels))
        low, high = 0.01, 1.0
        for _ in range(30):
            middle = (low + high) / 2
            if trainable_params(build_model(arch, num_classes, in_channels, width=middle)) >= target:
                high = middle
            else:
                low = middle
    # Up, never down: round(high, 3) gave 0.992 at gamma 1, i.e. 127 of conv3's 128 channels, a model
    # smaller than FedHM's, so the width strategies were compared with less than the same budget.
    return math.ceil(high * 1000) / 1000


def levels_for(scale: LevelScale, num_clients: int, tiered: bool, data: LabeledData, arch: str = ARCH) -> list[float]:
    if not tiered or not scale.sized:
        return [1.0] * num_clients
    tiers = (
        list(RANKS) if scale == RANK else [matched_width(g, data.num_classes, data.in_channels, arch) for g in RANKS]
    )
    return [tiers[i * len(tiers) // num_clients] for i in range(num_clients)]


def run_setting(
    name: str,
    setting: Setting,
    data: LabeledData,
    rounds: int,
    train: TrainConfig,
    arch: str = ARCH,
    limits: dict[str, object] = screening.OFF,
) -> dict:
    """One cell; ``limits`` are fleet.yaml's (the upload gate's screening off by default, see the module doc)."""
    spec = setting.partition
    registered, params = strategy_of(name)
    cls = STRATEGIES[registered]
    levels = levels_for(cls.levels, spec.num_clients, setting.tiered, data, arch)
    clients = [
        SimClient(
            f"client-{i}",
            levels[i],
            client_shard(data.train_x, data.train_y, spec, i, data.num_classes),
            client_shard(data.test_x, data.test_y, spec, i, data.num_classes),
        )
        for i in range(spec.num_clients)
    ]
    empty = [c.client_id for c in clients if len(c.train[1]) == 0]
    if empty:
        raise ValueError(
            f"{setting.label} (seed {spec.seed}) leaves {', '.join(empty)} without training data; "
            "use more --train-samples or fewer clients"
        )
    model = ModelSpec(arch, data.num_classes, data.in_channels, data.image_size)
    strategy = build_strategy(registered, model, params, spec.seed)
    torch.manual_seed(spec.seed)
    start = time.perf_counter()
    test = (data.test_x, data.test_y)
    result = simulate(
        strategy, clients, rounds, train, test, data.train_x[:256], limits=limits, participation=setting.participation
    )
    return {
        "accuracy": last_rounds_mean([r.accuracy for r in result.rounds]),
        "personalized_accuracy": last_rounds_mean([r.personalized_accuracy for r in result.rounds]),
        "final_accuracy": result.final.accuracy,
        "upload_bytes_per_round": result.upload_bytes_per_round,
        "failed_rounds": len(result.failed_rounds),
        "seconds": time.perf_counter() - start,
    }


def load_data(dataset: str, train_samples: int, test_samples: int) -> LabeledData:
    """digits at 8x8, or a fixed random subset (seed 0) of Fashion-MNIST at 28x28."""
    if dataset == "digits":
        return load_dataset("digits", 8, 1)
    data = load_dataset(FASHION_MNIST, 28, 1)
    generator = torch.Generator().manual_seed(0)
    train = torch.randperm(len(data.train_y), generator=generator)[:train_samples]
    test = torch.randperm(len(data.test_y), generator=generator)[:test_samples]
    return LabeledData(data.train_x[train], data.train_y[train], data.test_x[test], data.test_y[test], data.num_classes)


_WORKER_DATA: list[LabeledData] = []


def _load_in_worker(load: Callable[[], LabeledData]) -> None:
    torch.set_num_threads(1)
    _WORKER_DATA.append(load())


def _run_in_worker(
    name: str, setting: Setting, rounds: int, train: TrainConfig, arch: str, limits: dict[str, object]
) -> dict:
    return run_setting(name, setting, _WORKER_DATA[0], rounds, train, arch, limits)


def cells_of(names: list[str], seeds: int, clients: int, strategies: list[str]) -> list[tuple[str, int, Setting, str]]:
    """Every (scenario, seed, setting, strategy) cell, in the order they run."""
    return [
        (scenario, seed, setting, name)
        for scenario in names
        for seed in range(seeds)
        for setting in scenarios(clients, seed)[scenario]
        for name in strategies
    ]


def cell_key(scenario: str, seed: int, setting: Setting, name: str) -> str:
    """A cell's name in the cache (not its configuration, which the cache's header holds)."""
    return f"{scenario}/{setting.label}/seed {seed}/{name}"


def compare(
    names: list[str],
    rounds: int,
    seeds: int,
    clients: int,
    train: TrainConfig,
    strategies: list[str],
    data: LabeledData,
    arch: str = ARCH,
    jobs: int = 1,
    load: Callable[[], LabeledData] | None = None,
    cache: CellCache | None = None,
    limits: dict[str, object] = screening.OFF,
) -> dict:
    """Every (scenario, seed, setting, strategy) cell; ``jobs`` > 1 runs them in that many processes.

    Each cell trains on one thread, so ``jobs`` processes use ``jobs`` cores; a worker reads the data
    once with ``load`` (the same call that made ``data``). Results do not depend on ``jobs``.
    Cells found in ``cache`` are taken from it, and each finished cell is added to it.
    """
    tasks = cells_of(names, seeds, clients, strategies)
    keys = [cell_key(*task) for task in tasks]
    cached = {i: row for i, key in enumerate(keys) if cache is not None and (row := cache.get(key)) is not None}
    futures: dict[int, Future[dict]] = {}
    pool: Executor | None = None
    if jobs > 1:
        if load is None:
            raise ValueError("compare with jobs > 1 needs load, to read the data in each worker")
        context = multiprocessing.get_context("spawn")
        pool = ProcessPoolExecutor(jobs, mp_context=context, initializer=_load_in_worker, initargs=(load,))
        futures = {
            i: pool.submit(_run_in_worker, name, setting, rounds, train, arch, limits)
            for i, (_scenario, _seed, setting, name) in enumerate(tasks)
            if i not in cached
        }
    out: dict[str, dict] = {}
    cells: dict[str, dict[str, dict[str, Cell]]] = {}
    try:
        for i, (scenario, seed, setting, name) in enumerate(tasks):
            if i in cached:
                row = cached[i]
            else:
                row = (
                    futures[i].result()
                    if pool is not None
                    else run_setting(name, setting, data, rounds, train, arch, limits)
                )
                if cache is not None:
                    cache.put(keys[i], row)
            print(
                f"[{i + 1}/{len(tasks)}] {scenario}/{setting.label} seed {seed} {name}: accuracy "
                f"{row['accuracy']:.3f}, personalized {row['personalized_accuracy']:.3f} ({row['seconds']:.0f} s"
                f"{', from the cache' if i in cached else ''})",
                file=sys.stderr,
                flush=True,
            )
            cell = cells.setdefault(scenario, {}).setdefault(setting.label, {}).setdefault(name, Cell())
            cell.accuracy.append(row["accuracy"])
            cell.final.append(row.get("final_accuracy", row["accuracy"]))
            cell.personalized.append(row["personalized_accuracy"])
            cell.upload.append(row["upload_bytes_per_round"])
            cell.seconds.append(row["seconds"])
            cell.failed_rounds += row["failed_rounds"]
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    for scenario, by_label in cells.items():
        for label, by_strategy in by_label.items():
            out[f"{scenario}/{label}"] = {
                name: over_seeds(
                    {
                        "accuracy": c.accuracy,
                        "final_accuracy": c.final,
                        "personalized_accuracy": c.personalized,
                        "upload_bytes_per_round": c.upload,
                        "wall_seconds": c.seconds,
                    },
                    means_only=("upload_bytes_per_round", "wall_seconds"),
                )
                | {"failed_rounds": c.failed_rounds}
                for name, c in by_strategy.items()
            }
    return out


def _at_least(results: dict, setting: str, metric: str, name: str, baseline: str) -> dict[str, Any]:
    ours, theirs = results[setting][name][metric], results[setting][baseline][metric]
    mean, low, high = paired_interval(ours["seeds"], theirs["seeds"])
    return {
        "verdict": verdict(low, high),
        "difference": mean,
        "interval": interval_of(low, high),
        "detail": f"{name} - {baseline} = {mean:+.3f}, {CONFIDENCE:.0%} CI [{low:+.3f}, {high:+.3f}] over "
        f"{len(ours['seeds'])} seeds ({name} {ours['mean']:.3f}, {baseline} {theirs['mean']:.3f})",
    }


def claims(results: dict) -> list[dict]:
    """The seed papers' claims, one PASS/TIE/FAIL line per setting where every strategy involved ran."""
    checks = []
    for setting, rows in results.items():
        scenario = setting.split("/")[0]
        wanted: list[tuple[str, str, str, str]] = []
        if scenario in ("hetero-devices", "large-fleet"):
            wanted += [("FedHM >= HeteroFL, global, same device mix", "accuracy", "fedhm", "heterofl")]
            wanted += [("FedHM >= FedRolex, global, same device mix", "accuracy", "fedhm", "fedrolex")]
            wanted += [("FedFac >= FedAvg, personalized", "personalized_accuracy", "fedfac", "fedavg")]
        if scenario in ("permuted-labels", "domains"):
            wanted += [("Factorized-FL >= FedAvg, personalized", "personalized_accuracy", "factorized_fl", "fedavg")]
            simfed = "simfed_paper" if "simfed_paper" in rows else "simfed"
            settings = " (paper's tau 0.9, alpha 30)" if simfed == "simfed_paper" else " (fedfleet's defaults)"
            wanted += [(f"SimFed{settings} >= FedAvg, personalized", "personalized_accuracy", simfed, "fedavg")]
        for claim, metric, name, baseline in wanted:
            if name not in rows or baseline not in rows:
                continue
            check = _at_least(results, setting, metric, name, baseline)
            if name == "factorized_fl":
                ratio = rows[name]["upload_bytes_per_round"] / rows[baseline]["upload_bytes_per_round"]
                if ratio > 0.1:
                    check["verdict"] = "FAIL"
                claim = claim + " with <= 1/10 of the upload"
                check["detail"] += f"; upload ratio {ratio:.3f}"
            checks.append({"setting": setting, "claim": claim, **check, "pass": check["verdict"] == "PASS"})
    return checks


def claim_lines(checks: list[dict]) -> str:
    return "\n".join(f"{c['verdict']} {c['setting']}: {c['claim']} ({c['detail']})" for c in checks)


def print_tables(results: dict, rounds: int, seeds: int, dataset: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for scenario, rows in results.items():
        table = Table(title=f"{scenario}: {dataset}, {rounds} rounds, {seeds} seed(s), mean +- std, * = paper's metric")
        for column in ("strategy", "global acc", "personalized acc", "upload / client / round", "wall s"):
            table.add_column(column, justify="left" if column == "strategy" else "right")
        for name, row in rows.items():
            acc, pers = row["accuracy"], row["personalized_accuracy"]
            marks = {m: "*" if PAPER_METRIC.get(name) == m else "" for m in ("accuracy", "personalized_accuracy")}
            table.add_row(
                name,
                f"{acc['mean']:.3f} +- {acc['std']:.3f}{marks['accuracy']}",
                f"{pers['mean']:.3f} +- {pers['std']:.3f}{marks['personalized_accuracy']}",
                f"{row['upload_bytes_per_round'] / 1024:.1f} KiB",
                f"{row['wall_seconds']:.1f}",
            )
        console.print(table)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.compare",
        description="Run every registered strategy side by side (in-process clients, no broker).",
    )
    parser.add_argument(
        "--scenario",
        required=True,
        choices=[*SCENARIOS, "fedlora", "all"],
        help="hetero-devices, permuted-labels, domains, large-fleet, all (those four), or fedlora",
    )
    parser.add_argument(
        "--dataset",
        choices=["digits", FASHION_MNIST],
        default="digits",
        help="digits (built in, default) or fashion_mnist (apt-get install dataset-fashion-mnist)",
    )
    parser.add_argument("--train-samples", type=int, default=2000, help="fashion_mnist training subset (default 2000)")
    parser.add_argument("--test-samples", type=int, default=1000, help="fashion_mnist test subset (default 1000)")
    parser.add_argument("--rounds", type=int, help="federated rounds (default: 10; fedlora 20)")
    parser.add_argument(
        "--seeds", type=int, default=5, help="seeds 0..K-1, paired across strategies (default: 5; claims need >= 2)"
    )
    parser.add_argument("--clients", type=int, help="number of clients (default: 8; fedlora 50, all asked every round)")
    parser.add_argument(
        "--participation",
        type=float,
        help="fedlora scenario: share of the clients asked per round (default 1: under Dirichlet(0.1) fewer "
        "leave each seed's scored rounds a different class mix, docs/strategies.md)",
    )
    parser.add_argument("--epochs", type=int, default=1, help="local epochs per round (default: 1)")
    parser.add_argument(
        "--screening",
        action="store_true",
        help="keep the upload gate's screening at fleet.yaml's defaults (update bound, peer check); by default "
        "it is off, so that honest non-IID updates are neither clipped nor refused (benchmarks/screening.py)",
    )
    parser.add_argument(
        "--strategies",
        help="comma-separated subset (default: every registered one the scenario applies to, and the paper "
        f"presets: {', '.join([*STRATEGIES, *PRESETS])})",
    )
    parser.add_argument(
        "--jobs", type=int, default=1, help="cells run in this many processes, one core each (default: 1)"
    )
    parser.add_argument(
        "--arch",
        choices=ARCHS,
        help="cnn (digits' default), cnn28 (fashion_mnist's default) or resnet9 (factorized convolutions matter)",
    )
    parser.add_argument(
        "--cache",
        type=Path,
        metavar="FILE",
        help="keep each finished cell in FILE (JSON lines) and take the cells already there: a stopped run resumes",
    )
    parser.add_argument(
        "--allow-other-commit",
        action="store_true",
        help="take --cache cells written at another commit (or from a dirty tree) too; by default they are refused",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    lora_bed = fedlora.Bed()
    if args.rounds is None:
        args.rounds = lora_bed.rounds if args.scenario == "fedlora" else 10
    if args.clients is None:
        args.clients = lora_bed.clients if args.scenario == "fedlora" else 8
    for flag in ("rounds", "seeds", "clients", "epochs", "train_samples", "test_samples", "jobs"):
        if getattr(args, flag) < 1:
            print(f"--{flag.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    if args.clients < 2:
        print("--clients must be >= 2 (the domains scenario has two domains)", file=sys.stderr)
        return 2
    if args.participation is not None and args.scenario != "fedlora":
        print("--participation is the fedlora scenario's (the others fix theirs)", file=sys.stderr)
        return 2
    if args.participation is not None and not 0 < args.participation <= 1:
        print("--participation must be in (0, 1]", file=sys.stderr)
        return 2
    names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    known = [*STRATEGIES, *PRESETS]
    strategies = known if args.strategies is None else [s.strip() for s in args.strategies.split(",")]
    unknown = [s for s in strategies if s not in known]
    if unknown:
        print(f"unknown strategies: {', '.join(unknown)}; known: {', '.join(known)}", file=sys.stderr)
        return 2
    pretrained = fine_tuning(strategies) if args.scenario != "fedlora" else []
    why = (
        "fine-tuning strategies start from a pre-trained ViT, not the CNN trained from scratch "
        "(run them with --scenario fedlora)"
    )
    if pretrained and args.strategies is not None:
        print(f"--strategies {', '.join(pretrained)}: {why}", file=sys.stderr)
        return 2
    if pretrained:
        print(f"skipped {', '.join(pretrained)}: {why}", file=sys.stderr)
        strategies = [s for s in strategies if s not in pretrained]
    torch.set_num_threads(1)
    arch = args.arch or DEFAULT_ARCH[args.dataset]
    # Taken once, before the first cell: the tree a long run started from, not whatever it is when it ends.
    provenance = describe()
    if args.scenario == "fedlora":
        other = [s for s in strategies if s not in fine_tuning([s])]
        if args.strategies is not None and other:
            print(
                f"--strategies {', '.join(other)}: the fedlora scenario runs fine-tuning strategies only",
                file=sys.stderr,
            )
            return 2
        chosen = None if args.strategies is None else strategies
        participation = lora_bed.participation if args.participation is None else args.participation
        bed = replace(lora_bed, rounds=args.rounds, clients=args.clients, epochs=args.epochs)
        bed = replace(bed, participation=participation, screening=args.screening)
        try:
            report = fedlora.report(bed, args.seeds, chosen, args.jobs, args.cache, args.allow_other_commit)
        except (DatasetError, CacheMismatch) as error:
            print(f"fedlora: {error}", file=sys.stderr)
            return 2
        print(json.dumps(report | {"provenance": provenance}, indent=2) if args.json else fedlora.table(report))
        return 0
    train = TrainConfig(epochs=args.epochs, batch_size=32, lr=0.05)
    limits = screening.limits(args.screening)
    load = partial(load_data, args.dataset, args.train_samples, args.test_samples)
    try:
        data = load()
    except DatasetError as error:
        print(f"--dataset {args.dataset}: {error}", file=sys.stderr)
        return 2
    cache = None
    if args.cache is not None:
        config = {
            "dataset": args.dataset,
            "train_samples": args.train_samples,
            "test_samples": args.test_samples,
            "arch": arch,
            "rounds": args.rounds,
            "clients": args.clients,
            "train": train.model_dump(),
            "limits": limits,
        }
        try:
            cache = CellCache(args.cache, config, provenance, args.allow_other_commit)
        except (CacheMismatch, OSError) as error:
            print(f"--cache: {error}", file=sys.stderr)
            return 2
    results = compare(
        names, args.rounds, args.seeds, args.clients, train, strategies, data, arch, args.jobs, load, cache, limits
    )
    checks = claims(results)
    if cache is not None:
        # Which commit computed the table's cells: one, unless --allow-other-commit took another's.
        keys = [cell_key(*task) for task in cells_of(names, args.seeds, args.clients, strategies)]
        provenance |= {"cells_by_commit": cache.commits(keys)}
    if args.json:
        print(
            json.dumps(
                results
                | {"dataset": args.dataset, "arch": arch, "paper_metric": PAPER_METRIC, "checks": checks}
                | {"screening": args.screening, "limits": limits}
                | {"provenance": provenance},
                indent=2,
            )
        )
    else:
        print_tables(results, args.rounds, args.seeds, args.dataset)
        print(claim_lines(checks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
