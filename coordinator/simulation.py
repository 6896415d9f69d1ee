"""Run any strategy for N rounds with in-process clients: the rounds engine without a fleet.

Each round: ``configure`` -> the client program named by the assignment -> ``train_local`` ->
``upload`` (+ ``extras``) folded into the round aggregate -> ``close_round``. Then evaluation:

- global accuracy: the strategy's global model on the shared test set, after static BN
  (running statistics recomputed on the caller's calibration data and handed back to the
  strategy, so its next payloads carry them);
- personalized accuracy: the model each client would hold after this round (its next
  assignment plus what it kept on device), BN recalibrated on its own training data, on its
  own test shard (same distribution as its training shard); the mean over clients.

Upload bytes are what each client's upload and extras occupy as tensors (fp32 unless a program
chooses otherwise), per client per round. This is what the comparison harness and the unit
tests use; the real coordinator drives the same strategy objects over MQTT.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn

from coordinator.strategies.base import ClientSlot, Strategy
from device_agent.clients import build_program
from device_agent.training import TrainConfig, train_local

Split = tuple[Tensor, Tensor]


@dataclass(frozen=True)
class SimClient:
    client_id: str
    level: float
    train: Split
    test: Split

    @property
    def slot(self) -> ClientSlot:
        return ClientSlot(self.client_id, self.level, len(self.train[1]))


@dataclass(frozen=True)
class RoundRecord:
    round: int
    upload_bytes: dict[str, int]
    seconds: float
    accuracy: float | None = None
    personalized_accuracy: float | None = None


@dataclass
class SimulationResult:
    rounds: list[RoundRecord] = field(default_factory=list)

    @property
    def final(self) -> RoundRecord:
        return self.rounds[-1]

    @property
    def upload_bytes_per_round(self) -> float:
        """Mean bytes one client uploads in one round."""
        sizes = [b for record in self.rounds for b in record.upload_bytes.values()]
        return sum(sizes) / len(sizes) if sizes else 0.0


def tensor_bytes(tensors: Mapping[str, Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


@torch.no_grad()
def calibrate_batchnorm(model: nn.Module, x: Tensor, batch_size: int = 256) -> dict[str, Tensor]:
    """Static BN: running statistics recomputed from ``x`` (cumulative average over batches)."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return {}
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None
    model.train()
    for batch in x.split(batch_size):
        model(batch)
    model.eval()
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "running_" in k or "num_batches" in k}


@torch.no_grad()
def accuracy(model: nn.Module, data: Split, batch_size: int = 512) -> float:
    model.eval()
    x, y = data
    correct = sum(
        int((model(xb).argmax(1) == yb).sum()) for xb, yb in zip(x.split(batch_size), y.split(batch_size), strict=True)
    )
    return correct / max(len(y), 1)


def simulate(
    strategy: Strategy,
    clients: Sequence[SimClient],
    rounds: int,
    train: TrainConfig,
    test: Split,
    calibration: Tensor,
    evaluate_every: int = 0,
) -> SimulationResult:
    """Run ``rounds`` rounds; evaluate every ``evaluate_every`` rounds (0: the last round only)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if not clients:
        raise ValueError("a simulation needs at least one client")
    slots = [c.slot for c in clients]
    kept: dict[str, dict[str, Tensor]] = {}
    result = SimulationResult()
    for round in range(1, rounds + 1):
        start = time.perf_counter()
        assignments = strategy.configure(round, slots)
        aggregate = strategy.open_round(round, slots)
        sent: dict[str, int] = {}
        for index, client in enumerate(clients):
            assignment = assignments[client.client_id]
            program = build_program(assignment.meta, assignment.tensors, kept.get(client.client_id))
            train_local(program, client.train, replace(train, seed=train.seed * 1_000_003 + round * 1_000 + index))
            upload, extras = program.upload(), program.extras()
            aggregate.add(client.client_id, upload, len(client.train[1]), extras)
            kept[client.client_id] = program.keep()
            sent[client.client_id] = tensor_bytes(upload) + tensor_bytes(extras)
        strategy.close_round(aggregate)
        record = RoundRecord(round, sent, time.perf_counter() - start)
        if round == rounds or (evaluate_every and round % evaluate_every == 0):
            record = replace(
                record,
                accuracy=_global_accuracy(strategy, test, calibration),
                personalized_accuracy=_personalized_accuracy(strategy, clients, kept, round + 1),
            )
        result.rounds.append(record)
    return result


def _global_accuracy(strategy: Strategy, test: Split, calibration: Tensor) -> float:
    model = strategy.global_model()
    strategy.load_norm_statistics(calibrate_batchnorm(model, calibration))
    return accuracy(model, test)


def _personalized_accuracy(
    strategy: Strategy, clients: Sequence[SimClient], kept: Mapping[str, Mapping[str, Tensor]], next_round: int
) -> float:
    assignments = strategy.configure(next_round, [c.slot for c in clients])
    scores = []
    for client in clients:
        if len(client.test[1]) == 0:
            continue
        assignment = assignments[client.client_id]
        program = build_program(assignment.meta, assignment.tensors, kept.get(client.client_id))
        calibrate_batchnorm(program.model, client.train[0])
        scores.append(accuracy(program.model, client.test))
    return sum(scores) / len(scores)
