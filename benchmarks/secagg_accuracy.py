"""Does SecAgg's quantization cost accuracy? FedAvg on Fashion-MNIST twice per seed: the engine's float mean
of the devices' uploads, and the mean of their updates summed by SecAgg+ (device_agent.secagg, 16-bit fixed
point, every party in process), over the real round engine (``simulate``).

    python -m benchmarks.secagg_accuracy [--json] [--devices 10] [--rounds 5] [--seeds 3] [--clip 0.5] [--bits 16]

This is not the round engine running SecAgg over the transport (not built yet): the secure run's round folds
each upload's update (upload minus the global weights) into the protocol instead of a float sum, and the
strategy closes the round on the unmasked mean. Everything else (training, shards, evaluation) is the same, so
the accuracy gap is what quantization and the clip range do. Both runs average uniformly (equal IID shards) with
the upload gate's screening off (``benchmarks.screening.OFF``): under SecAgg the coordinator cannot screen.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence

import numpy as np
import torch

from benchmarks.compare import load_data
from benchmarks.machine import describe
from benchmarks.output import print_result
from benchmarks.screening import OFF
from coordinator.emulation.simulation import SimClient, simulate
from coordinator.strategies.base import ClientSlot, ModelSpec, RoundAggregate
from coordinator.strategies.width import FedAvg, FedAvgParams, WidthRound
from device_agent.data.datasets import LabeledData
from device_agent.data.partition import PartitionSpec, client_shard
from device_agent.secagg.graph import suggested
from device_agent.secagg.local import InProcessRun
from device_agent.secagg.messages import Params, Session
from device_agent.training.optimizer import TrainConfig

ARCH = "cnn28"


class UniformFedAvg(FedAvg, register=False):
    """FedAvg with every upload weighted 1 (a sample-weighted sum would need n_i x_i inside the clip range)."""

    weighting = "uniform"


class SecureFedAvg(UniformFedAvg, register=False):
    """Closes each round on the mean update that SecAgg+ unmasks, never on a float sum of uploads."""

    def __init__(self, model: ModelSpec, params: FedAvgParams, seed: int, clip: float, bits: int) -> None:
        super().__init__(model, params, seed)
        self.clip, self.bits = clip, bits
        self.clipped_values = 0
        self.total_values = 0

    def open_round(self, round: int, clients: Sequence[ClientSlot]) -> RoundAggregate:
        return SecureRound(self, round, clients)

    def close_round(self, aggregate: RoundAggregate) -> None:
        assert isinstance(aggregate, SecureRound)
        if aggregate.updates:
            aggregate.unmask()
        super().close_round(aggregate)


class SecureRound(WidthRound):
    strategy: SecureFedAvg

    def __init__(self, strategy: SecureFedAvg, round: int, clients: Sequence[ClientSlot]) -> None:
        super().__init__(strategy, round, clients)
        self.updates: dict[str, np.ndarray] = {}

    def fold(self, client_id, tensors, num_samples, extras=None) -> None:
        base = self.strategy.global_state()
        update = [(tensors[key].double() - base[key].double()).reshape(-1).numpy() for key in self.sums]
        self.updates[client_id] = np.concatenate(update)
        self.received.append(client_id)

    def unmask(self) -> None:
        strategy, devices = self.strategy, tuple(sorted(self.updates))
        length = len(next(iter(self.updates.values())))
        threshold, neighbours = suggested(len(devices))
        params = Params(devices, threshold, neighbours, length=length, clip=strategy.clip, bits=strategy.bits)
        strategy.clipped_values += sum(int(np.sum(np.abs(u) > strategy.clip)) for u in self.updates.values())
        strategy.total_values += length * len(devices)
        session = Session("bench", "secagg-accuracy", self.round)
        total = InProcessRun(session, params, self.updates, clip=True).run().total
        base, offset = strategy.global_state(), 0
        for key in self.sums:  # close_round divides sums by counts: k x (global + mean update) / k
            size = base[key].numel()
            part = torch.from_numpy(total[offset : offset + size]).reshape(base[key].shape)
            self.sums[key] = len(devices) * base[key].double() + part
            self.counts[key] = torch.full_like(self.sums[key], float(len(devices)))
            offset += size


def run(secure: bool, args: argparse.Namespace, data: LabeledData, seed: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """The run's accuracy per round (and clipped fraction), and the final global trainable weights."""
    torch.set_num_threads(1)
    spec = PartitionSpec("iid", args.devices, seed=seed)
    clients = [
        SimClient(
            f"d{i:03d}",
            1.0,
            client_shard(data.train_x, data.train_y, spec, i, data.num_classes),
            client_shard(data.test_x, data.test_y, spec, i, data.num_classes),
        )
        for i in range(args.devices)
    ]
    model = ModelSpec(ARCH, data.num_classes, data.in_channels, data.image_size)
    params = FedAvgParams()
    strategy = SecureFedAvg(model, params, seed, args.clip, args.bits) if secure else UniformFedAvg(model, params, seed)
    train = TrainConfig(lr=args.lr, epochs=args.epochs, batch_size=16, seed=seed)
    torch.manual_seed(seed)
    started = time.perf_counter()
    test = (data.test_x, data.test_y)
    result = simulate(strategy, clients, args.rounds, train, test, data.train_x[:256], limits=OFF)
    out = {
        "accuracy": [round(r.accuracy, 4) for r in result.rounds],
        "seconds": round(time.perf_counter() - started, 1),
    }
    if isinstance(strategy, SecureFedAvg):
        out["clipped_fraction"] = strategy.clipped_values / max(1, strategy.total_values)
    trainable = strategy.trainable()  # BatchNorm statistics are recomputed after aggregation, not averaged
    return out, {key: value for key, value in strategy.global_state().items() if key in trainable}


def compare_seed(seed: int, args: argparse.Namespace, data: LabeledData) -> dict:
    """Plain and secure runs from one seed: accuracies per round, and how far the final weights drifted apart."""
    (plain, plain_weights), (secure, secure_weights) = run(False, args, data, seed), run(True, args, data, seed)
    difference = torch.cat([(secure_weights[k] - plain_weights[k]).double().reshape(-1) for k in plain_weights])
    reference = torch.cat([value.double().reshape(-1) for value in plain_weights.values()])
    return {
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
    data = load_data("fashion_mnist", args.devices * args.samples_per_device, args.test_samples)
    rows = [compare_seed(seed, args, data) for seed in range(args.seeds)]
    plain = [row["plain"]["accuracy"][-1] for row in rows]
    secure = [row["secure"]["accuracy"][-1] for row in rows]
    result = {
        "benchmark": "secagg_accuracy",
        "dataset": "fashion_mnist",
        "arch": ARCH,
        "devices": args.devices,
        "rounds": args.rounds,
        "seeds": args.seeds,
        "clip": args.clip,
        "bits": args.bits,
        "plain_accuracy": round(statistics.fmean(plain), 4),
        "secure_accuracy": round(statistics.fmean(secure), 4),
        "gap_points": round(100 * (statistics.fmean(plain) - statistics.fmean(secure)), 2),
        # The seed-to-seed spread of the plain runs: how much a run's accuracy moves for reasons other than SecAgg.
        "plain_seed_std_points": round(100 * statistics.stdev(plain), 2) if len(plain) > 1 else None,
        "clipped_fraction": max(row["secure"]["clipped_fraction"] for row in rows),
        "runs": rows,
        "provenance": describe(),
    }
    print_result(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
