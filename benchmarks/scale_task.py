"""The scale benchmark's FedAvg task in one process, without MQTT: what another engine runs to compare.

``--scale --peer flower`` must give Flower exactly fedfleet's task, so everything here is fedfleet's own
code on the fleet ``scale_fleet(..., strategy="fedavg")`` describes: the model spec and data set
``coordinator emulate`` loads (``fleet_data``), each device's shard and test shard (``client_shard`` on
the fleet's partition and seed, as the agent computes them), the assignment's client spec and global
state from fedfleet's FedAvg strategy, the device's training settings and per-round seed, and
``train_assignment``, the very function an agent runs (evaluate the received model, train, evaluate,
pack). The round's close is fedfleet's too: the averaged model evaluated with ``evaluate_global``, whose
BatchNorm recalibration is handed on to the next round as the coordinator does.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from benchmarks.scale_fleet import DIGITS, ROUNDS, ScaleData, scale_fleet
from coordinator.config.fleet import Fleet, parse_fleet
from coordinator.rounds.closing import every_core
from coordinator.rounds.evaluation import evaluate_global
from coordinator.rounds.settings import EngineSettings
from coordinator.run.fleet_data import fleet_data
from coordinator.strategies import ModelSpec, build_strategy
from coordinator.strategies.base import ClientSlot, Strategy
from device_agent.clients.spec import SpecBase
from device_agent.data.datasets import LabeledData
from device_agent.data.partition import PartitionSpec, capped, client_shard
from device_agent.training.local_round import train_assignment
from device_agent.wire.protocol import round_seed

Split = tuple[Tensor, Tensor]
_PORT = 18830  # never bound: the fleet file only has to parse


@dataclass
class ScaleTask:
    """One size of the scale fleet under FedAvg; client ``i`` is the fleet's device ``i``."""

    fleet: Fleet
    model: ModelSpec
    data: LabeledData
    split: PartitionSpec
    strategy: Strategy
    spec: SpecBase
    keys: list[str]
    trainable: list[str]
    _shards: dict[int, tuple[Split, Split]] = field(default_factory=dict)

    @classmethod
    def build(
        cls, devices: int, data: ScaleData = DIGITS, rounds: int = ROUNDS, deadline_s: float | None = None
    ) -> ScaleTask:
        fleet = parse_fleet(scale_fleet(devices, _PORT, data, deadline_s, rounds, "fedavg"), source="scale")
        model, data = fleet_data(fleet)
        split = fleet.dataset.partition.spec(devices, fleet.dataset.seed)
        strategy = build_strategy(fleet.strategy.name, model, fleet.strategy.params, seed=fleet.dataset.seed)
        spec = strategy.configure(1, [ClientSlot("probe", 1.0, 1)])["probe"].spec
        keys, trainable = list(strategy.global_state()), list(strategy.trainable())
        return cls(fleet, model, data, split, strategy, spec, keys, trainable)

    @property
    def devices(self) -> int:
        return len(self.fleet.devices)

    def global_arrays(self) -> list[np.ndarray]:
        """The global model as the assignment carries it (every tensor, BatchNorm statistics included)."""
        state = self.strategy.global_state()
        return [state[key].numpy() for key in self.keys]

    def shard(self, index: int) -> tuple[Split, Split]:
        """Device ``index``'s (train, test) shards, as its agent loads them."""
        if index not in self._shards:
            data, classes = self.data, self.data.num_classes
            train = client_shard(data.train_x, data.train_y, self.split, index, classes)
            self._shards[index] = (
                capped(train, self.fleet.dataset.samples_per_device, self.fleet.dataset.seed),
                client_shard(data.test_x, data.test_y, self.split, index, classes),
            )
        return self._shards[index]

    def seed(self, index: int, round: int) -> int:
        """Device ``index``'s training seed in ``round``, as the coordinator deals it (run seed, sorted device ids)."""
        order = sorted(device.id for device in self.fleet.devices)
        return round_seed(self.fleet.dataset.seed, round, order.index(self.fleet.devices[index].id))

    def client_update(self, index: int, round: int, arrays: Sequence[np.ndarray]) -> tuple[list[np.ndarray], int]:
        """Device ``index``'s work in ``round`` on the global ``arrays``: its upload (trainable tensors) and samples."""
        tensors = {key: torch.tensor(np.asarray(array)) for key, array in zip(self.keys, arrays, strict=True)}
        train = self.fleet.training.for_device(self.fleet.devices[index], self.seed(index, round))
        shard, test = self.shard(index)
        trained = train_assignment(self.spec, train, tensors, None, shard, test)
        return [trained.upload[key].detach().numpy() for key in self.trainable], len(shard[1])

    def close_round(self, averaged: Sequence[np.ndarray]) -> tuple[list[np.ndarray], float]:
        """The averaged trainable tensors in, the next round's global arrays and the global accuracy out."""
        state = self.strategy.global_state()
        for key, array in zip(self.trainable, averaged, strict=True):
            state[key] = torch.tensor(np.asarray(array)).to(state[key].dtype)
        self.strategy.load_state_dict({f"global.{key}": value for key, value in state.items()})
        calibration = self.data.train_x[: EngineSettings.of(self.fleet, self.devices, 0.0).calibration_samples]
        with every_core():  # as the coordinator's round close evaluates, whatever threads the process started with
            accuracy, _ = evaluate_global(self.strategy, (self.data.test_x, self.data.test_y), calibration)
        return self.global_arrays(), accuracy


def compute_floor(task: ScaleTask, repeats: int = 3) -> dict[str, float]:
    """N x one device's round of host compute (one thread) / this host's cores: no engine can round faster.

    Device 0's ``client_update`` on the initial model, median of ``repeats`` (a round's seed each).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        arrays, seconds = task.global_arrays(), []
        for number in range(1, repeats + 1):
            start = time.perf_counter()
            task.client_update(0, number, arrays)
            seconds.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    one, cores = statistics.median(seconds), len(os.sched_getaffinity(0))
    return {"one_client_seconds": round(one, 4), "compute_floor_seconds": round(task.devices * one / cores, 3)}
