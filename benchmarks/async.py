"""Time to accuracy on the fleet's own clock: sync FedHM rounds against FedBuff (async FedHM, async FedAvg).

    python -m benchmarks.async --json [--seeds 3] [--per-class 10] [--target 0.65] [--jobs 3]

An emulated heterogeneous fleet (``--per-class`` devices of each of three device classes, Jetson Orin Nano 8 GB,
Raspberry Pi 5 and Raspberry Pi 4: the planner's device seconds per assignment differ by more than 10x, the
``spread`` in the JSON) trains the small CNN on a Dirichlet(``--alpha``) split of a Fashion-MNIST subset, resized to
``--image-size`` pixels (14 by default: a 2-core shared host trains every update of 30 devices x 3 modes x 3 seeds
in minutes; the clock is the planner's for that model and size, so the comparison holds). Every assignment
takes the device time the planner predicts for that device at its level (``coordinator.emulation.fleet_clock``:
a discrete-event simulation, the host trains every update for real), so the figures are device seconds and mean
the same on a loaded or a quiet host. FedHM's levels are the planner's for ``--deadline`` seconds a round; FedAvg
trains the whole model everywhere.

Per seed: the device time at which the global model first reached ``--target`` accuracy in each mode, and the
accuracy each mode's global model had at the same device time (the earliest of the three times to target, so
that every mode ran at least that long). ``speedup`` is sync FedHM's time over async FedHM's, per seed.
The module is named ``async`` (a keyword): tests import it with importlib.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from typing import Any

import torch

from benchmarks.compare import load_data
from benchmarks.machine import describe
from benchmarks.output import print_result
from coordinator.config.asynchronous import AsyncSettings
from coordinator.config.fleet import parse_fleet
from coordinator.emulation.fleet_clock import ClockRun, planned_devices, run_async, run_sync, speed_spread
from coordinator.strategies import ModelSpec, build_strategy
from device_agent.clients.spec import TrainConfig
from device_agent.data.datasets import FASHION_MNIST, LabeledData, fit_to_model
from device_agent.data.partition import PartitionSpec, client_shard
from profiles.catalog import load_catalog

CLASSES = ("jetson-orin-nano-8gb", "raspberry-pi-5", "raspberry-pi-4")
ARCH = "cnn"
MODES = ("sync_fedhm", "async_fedhm", "async_fedavg")


def fleet_yaml(
    strategy: str, shards: dict[str, int], profiles: dict[str, str], deadline: float, image_size: int = 14
) -> dict[str, Any]:
    """The benchmark's fleet.yaml: one device per shard, sized at its shard (what the planner plans with)."""
    return {
        "fleet": "async-benchmark",
        "transport": {"broker": {"mode": "managed"}},
        "model": {"arch": ARCH, "num_classes": 10, "in_channels": 1, "image_size": image_size},
        "dataset": {"name": FASHION_MNIST},
        "strategy": {"name": strategy},
        "ratios": [1, 0.5, 0.25, 0.125] if strategy == "fedhm" else [1],
        "round_deadline_s": deadline if strategy == "fedhm" else 3600,
        "training": {"local_epochs": 1, "batch_size": 32, "optimizer": "momentum", "lr": 0.05},
        "devices": [
            {"id": device, "profile": profiles[device], "overrides": {"samples": samples}}
            for device, samples in shards.items()
        ],
    }


def run_seed(data: LabeledData, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    catalog = load_catalog()
    count = args.per_class * len(CLASSES)
    spec = PartitionSpec("dirichlet", count, seed, alpha=args.alpha)
    profiles = {f"{CLASSES[i % len(CLASSES)]}-{i:02d}": CLASSES[i % len(CLASSES)] for i in range(count)}
    splits = {device: client_shard(data.train_x, data.train_y, spec, i) for i, device in enumerate(profiles)}
    splits = {device: split for device, split in splits.items() if len(split[1])}  # an empty shard trains nothing
    shards = {device: len(split[1]) for device, split in splits.items()}
    calibration = data.train_x[torch.randperm(len(data.train_y), generator=torch.Generator().manual_seed(seed))[:256]]
    test = (data.test_x, data.test_y)
    train = TrainConfig(optimizer="momentum", lr=0.05, epochs=1, batch_size=32, seed=seed)
    model = ModelSpec(ARCH, 10, 1, args.image_size)
    settings = AsyncSettings(buffer=args.buffer, server_lr=args.server_lr, max_staleness=args.max_staleness)
    runs: dict[str, ClockRun] = {}
    host: dict[str, float] = {}
    plans = {}
    for mode in MODES:
        name = "fedavg" if mode.endswith("fedavg") else "fedhm"
        fleet = parse_fleet(fleet_yaml(name, shards, profiles, args.deadline, args.image_size), catalog)
        devices = planned_devices(fleet, catalog, splits)
        plans[mode] = devices
        strategy = build_strategy(name, model, seed=seed)
        started = time.perf_counter()
        if mode.startswith("sync"):
            runs[mode] = run_sync(strategy, devices, train, test, calibration, args.max_seconds, args.target)
        else:
            runs[mode] = run_async(strategy, settings, devices, train, test, calibration, args.max_seconds, args.target)
        host[mode] = time.perf_counter() - started
    reached = {mode: run.time_to_accuracy(args.target) for mode, run in runs.items()}
    same = min([t for t in reached.values() if t is not None], default=args.max_seconds)
    sync, fast = reached["sync_fedhm"], reached["async_fedhm"]
    return {
        "seed": seed,
        "devices": len(splits),
        "levels": {
            mode: {c: sorted({d.level for d in ds if profiles[d.device] == c}) for c in CLASSES}
            for mode, ds in plans.items()
        },
        "device_seconds_per_assignment": {
            c: statistics.median(d.seconds for d in plans["sync_fedhm"] if profiles[d.device] == c) for c in CLASSES
        },
        "spread": round(speed_spread(plans["async_fedavg"]), 1),
        "time_to_target_s": {mode: None if t is None else round(t, 2) for mode, t in reached.items()},
        "same_time_s": round(same, 2),
        "accuracy_at_same_time": {mode: round(run.accuracy_at(same), 4) for mode, run in runs.items()},
        "best_accuracy": {mode: round(run.best, 4) for mode, run in runs.items()},
        "speedup": None if sync is None or fast is None else round(sync / fast, 2),
        "updates": {mode: run.folded for mode, run in runs.items()},
        "versions": {mode: run.points[-1].version for mode, run in runs.items()},
        "staleness": {mode: dict(sorted(run.staleness.items())) for mode, run in runs.items() if run.mode == "async"},
        "refused": {mode: dict(run.refused) for mode, run in runs.items() if run.mode == "async"},
        "host_seconds": {mode: round(s, 1) for mode, s in host.items()},
    }


def _seed_in_worker(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """One seed, in this process or a pool's: one torch thread, the data loaded (and resized) here."""
    torch.set_num_threads(1)
    data = load_data(FASHION_MNIST, args.train_samples, args.test_samples)
    if args.image_size != 28:
        data = fit_to_model(data, args.image_size, 1)
    return run_seed(data, seed, args)


def summarize(per_seed: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over seeds; a mode that missed the target in a seed has no mean time."""
    out: dict[str, Any] = {}
    for mode in MODES:
        times = [s["time_to_target_s"][mode] for s in per_seed]
        out[mode] = {
            "time_to_target_s": None if None in times else round(statistics.mean(times), 2),
            "reached": sum(t is not None for t in times),
            "accuracy_at_same_time": round(statistics.mean(s["accuracy_at_same_time"][mode] for s in per_seed), 4),
        }
    speedups = [s["speedup"] for s in per_seed]
    out["speedup_async_fedhm_over_sync_fedhm"] = {
        "per_seed": speedups,
        "mean": None if None in speedups else round(statistics.mean(speedups), 2),
        "min": None if None in speedups else min(speedups),
    }
    return out


def headlines(summary: dict[str, Any], per_seed: list[dict[str, Any]], target: float) -> dict[str, Any]:
    """The top-level figures the README table shows (``benchmarks.table``), all derived from ``summary``."""
    speedup = summary["speedup_async_fedhm_over_sync_fedhm"]
    return {
        "speedup_mean": speedup["mean"],
        "speedup_min": speedup["min"],
        "goal_met": speedup["min"] is not None and speedup["min"] >= 2,
        "target": target,
        **{f"tta_{mode}_s": summary[mode]["time_to_target_s"] for mode in MODES},
        **{f"accuracy_same_time_{mode}": summary[mode]["accuracy_at_same_time"] for mode in MODES},
        "devices": min(s["devices"] for s in per_seed),
        "spread": min(s["spread"] for s in per_seed),
        "seeds": len(per_seed),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.async", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--per-class", type=int, default=10, help="devices of each of the three classes")
    parser.add_argument("--train-samples", type=int, default=1500, help="Fashion-MNIST training subset")
    parser.add_argument("--test-samples", type=int, default=500, help="Fashion-MNIST test subset")
    parser.add_argument("--image-size", type=int, default=14, help="images resized to PX x PX")
    parser.add_argument("--jobs", type=int, default=1, help="seeds run in parallel, one process (one core) each")
    parser.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration of the label split")
    parser.add_argument("--target", type=float, default=0.65, help="target accuracy of the global model")
    parser.add_argument("--deadline", type=float, default=0.4, help="FedHM's round deadline, for the planner")
    parser.add_argument("--buffer", type=int, default=10, help="FedBuff's K")
    parser.add_argument("--server-lr", type=float, default=1.0)
    parser.add_argument("--max-staleness", type=int, default=20)
    parser.add_argument("--max-seconds", type=float, default=30.0, help="device seconds a mode may run at most")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    started = time.perf_counter()
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            per_seed = list(pool.map(partial(_seed_in_worker, args), range(args.seeds)))
    else:
        per_seed = [_seed_in_worker(args, seed) for seed in range(args.seeds)]
    summary = summarize(per_seed)
    result = {
        **headlines(summary, per_seed, args.target),
        "setting": {k: v for k, v in vars(args).items() if k != "json"} | {"classes": list(CLASSES), "arch": ARCH},
        "summary": summary,
        "per_seed": per_seed,
        "host_seconds": round(time.perf_counter() - started, 1),
        "provenance": describe(),
    }
    print_result(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
