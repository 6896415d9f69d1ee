"""Differential privacy's price: accuracy at epsilon = inf, 8 and 2 (delta 1e-5), FedAvg and FedHM, fixed and
adaptive clipping, on Fashion-MNIST with 100 in-process devices (the real round engine, device-side clipping,
coordinator noise and accountant).

    python -m benchmarks.privacy [--json] [--devices 100] [--rounds 10] [--seeds 3] [--jobs 2]

Every device takes part in every round (q = 1: with 100 devices, sampling would shrink the round's sum and with it
the signal the noise hides in). For a target epsilon the noise multiplier z is calibrated (dp-accounting) so the
configured rounds end exactly there; the accountant's reported epsilon is in the JSON. FedHM devices cycle through
rank ratios 1, 1/2, 1/4 and average uniformly. The JSON has one ``cells`` entry per run and ``summary`` per
(strategy, epsilon, clip) with the mean accuracy and its ``gap`` to epsilon = inf in points; ``goal_met`` says
whether epsilon = 8 stays within 5 points of inf. What decides it: the noise on the average is z C / k per
weight, so its norm over d weights is z C sqrt(d) / k against an update of norm at most C (docs/privacy.md).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import partial

import torch

from benchmarks.compare import load_data
from benchmarks.stats import mean_std
from coordinator.emulation.simulation import SimClient, simulate
from coordinator.privacy.accountant import calibrate
from coordinator.strategies import ModelSpec, build_strategy
from device_agent.data.datasets import LabeledData
from device_agent.data.partition import PartitionSpec, client_shard
from device_agent.models import build_model
from device_agent.training.optimizer import TrainConfig

ARCH = "cnn28"
DELTA = 1e-5
LEVELS = {"fedavg": (1.0,), "fedhm": (1.0, 0.5, 0.25)}
PARAMS = {"fedavg": {}, "fedhm": {"weighting": "uniform"}}
GOAL_POINTS = 5.0


@dataclass(frozen=True)
class Cell:
    strategy: str
    epsilon: float
    """math.inf: no privacy."""
    clip: str
    seed: int


def privacy_block(cell: Cell, args: argparse.Namespace) -> dict | None:
    if math.isinf(cell.epsilon):
        return None
    clip = {"mode": "fixed", "norm": args.clip_norm} if cell.clip == "fixed" else {"mode": "adaptive", "initial": 0.1}
    z = calibrate(args.devices, args.devices, args.rounds, cell.epsilon, DELTA)
    return {"noise_multiplier": z, "delta": DELTA, "clip": clip}


def run_cell(cell: Cell, args: argparse.Namespace, data: LabeledData) -> dict:
    torch.set_num_threads(1)
    spec = PartitionSpec("iid", args.devices, seed=cell.seed)
    levels = LEVELS[cell.strategy]
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
    strategy = build_strategy(cell.strategy, model, PARAMS[cell.strategy], cell.seed)
    train = TrainConfig(lr=args.lr, epochs=args.epochs, batch_size=16, seed=cell.seed)
    privacy = privacy_block(cell, args)
    torch.manual_seed(cell.seed)
    start = time.perf_counter()
    test = (data.test_x, data.test_y)
    result = simulate(strategy, clients, args.rounds, train, test, data.train_x[:256], privacy=privacy)
    return {
        "strategy": cell.strategy,
        "target_epsilon": None if math.isinf(cell.epsilon) else cell.epsilon,
        "clip": None if privacy is None else cell.clip,
        "seed": cell.seed,
        "noise_multiplier": None if privacy is None else round(privacy["noise_multiplier"], 4),
        "epsilon": result.final.epsilon,
        "accuracy": result.final.accuracy,
        "seconds": round(time.perf_counter() - start, 1),
    }


_WORKER_DATA: list[LabeledData] = []


def _load_in_worker(load: Callable[[], LabeledData]) -> None:
    torch.set_num_threads(1)
    _WORKER_DATA.append(load())


def _run_in_worker(cell: Cell, args: argparse.Namespace) -> dict:
    return run_cell(cell, args, _WORKER_DATA[0])


def cells_for(args: argparse.Namespace) -> list[Cell]:
    cells = []
    for strategy in args.strategies:
        for seed in range(args.seeds):
            for epsilon in args.epsilons:
                for clip in ["none"] if math.isinf(epsilon) else args.clips:
                    cells.append(Cell(strategy, epsilon, clip, seed))
    return cells


def summarize(results: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["strategy"], r["target_epsilon"], r["clip"]), []).append(r)
    baseline = {s: statistics.fmean(r["accuracy"] for r in rs) for (s, e, _), rs in groups.items() if e is None}
    out = []
    for (strategy, epsilon, clip), rs in groups.items():
        accuracy = mean_std([r["accuracy"] for r in rs])
        gap = 100 * (baseline[strategy] - accuracy["mean"]) if strategy in baseline else None
        out.append(
            {
                "strategy": strategy,
                "target_epsilon": epsilon,
                "clip": clip,
                "accuracy": accuracy,
                "gap_points": None if gap is None else round(gap, 2),
                "reported_epsilon": max((r["epsilon"] or 0.0) for r in rs) if epsilon is not None else None,
                "seeds": len(rs),
            }
        )
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--devices", type=int, default=100)
    parser.add_argument("--samples-per-device", type=int, default=60)
    parser.add_argument("--test-samples", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--clip-norm", type=float, default=1.0, help="the fixed clip norm C")
    parser.add_argument("--strategies", type=lambda s: s.split(","), default=["fedavg", "fedhm"])
    parser.add_argument("--epsilons", type=lambda s: [float(x) for x in s.split(",")], default=[math.inf, 8.0, 2.0])
    parser.add_argument("--clips", type=lambda s: s.split(","), default=["fixed", "adaptive"])
    parser.add_argument("--jobs", type=int, default=2)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load = partial(load_data, "fashion_mnist", args.devices * args.samples_per_device, args.test_samples)
    cells = cells_for(args)
    if args.jobs > 1:  # spawned, not forked: a fork of a process with torch's threads running can hang
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(args.jobs, mp_context=context, initializer=_load_in_worker, initargs=(load,)) as pool:
            results = list(pool.map(partial(_run_in_worker, args=args), cells))
    else:
        data = load()
        results = [run_cell(cell, args, data) for cell in cells]
    summary = summarize(results)
    at8 = [s for s in summary if s["target_epsilon"] == 8.0 and s["gap_points"] is not None]
    params = sum(p.numel() for p in build_model(ARCH, 10, 1).parameters())
    report = {
        "dataset": "fashion_mnist",
        "arch": ARCH,
        "parameters": params,
        "devices": args.devices,
        "samples_per_device": args.samples_per_device,
        "rounds": args.rounds,
        "seeds": args.seeds,
        "delta": DELTA,
        "participation": 1.0,
        "summary": summary,
        "worst_gap_at_epsilon_8": max((s["gap_points"] for s in at8), default=None),
        "goal_met": bool(at8) and all(s["gap_points"] <= GOAL_POINTS for s in at8),
        "cells": results,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for s in summary:
        eps = "inf" if s["target_epsilon"] is None else f"{s['target_epsilon']:g}"
        gap = "" if s["gap_points"] is None else f", gap {s['gap_points']:.1f} points"
        print(f"{s['strategy']:7s} eps {eps:>4s} clip {s['clip'] or '-':8s} accuracy {s['accuracy']['mean']:.4f}{gap}")
    print(f"goal (eps 8 within {GOAL_POINTS:g} points of inf): {'met' if report['goal_met'] else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
