"""How fedfleet measures a model: one definition each of static BN, accuracy and personalized accuracy.

- Global accuracy and loss: the strategy's global model on the coordinator's held-out test split,
  after static BN (HeteroFL's choice): BatchNorm running statistics recomputed on the coordinator's
  own calibration samples and handed back to the strategy, so its next payloads carry them.
- Personalized accuracy: the mean over a round's accepted devices of the accuracy each device
  reports for the model it just trained, on its own test shard (same partition as its training
  shard), after static BN on its own training data (``device_agent.training.optimizer.evaluate_local``).
  A personalized model's private part never leaves the device, so this is the only measure a
  real fleet has; the in-process simulation reports the same thing.
- Federated accuracy and loss: what the accepted devices measure for the model they received, before
  training, on their own test shards (``device_agent.training.federated_evaluation``), weighted by test samples.
  It needs no data on the coordinator, and it measures the global model of the round before.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from coordinator.strategies import Strategy
from device_agent.training.optimizer import calibrate_batchnorm
from device_agent.wire.protocol import ReceivedEvaluation

Split = tuple[Tensor, Tensor]


@torch.no_grad()
def accuracy(model: nn.Module, data: Split, batch_size: int = 512) -> float:
    model.eval()
    x, y = data
    correct = sum(
        int((model(xb).argmax(1) == yb).sum()) for xb, yb in zip(x.split(batch_size), y.split(batch_size), strict=True)
    )
    return correct / max(len(y), 1)


@torch.no_grad()
def evaluate_global(strategy: Strategy, test: Split, calibration: Tensor) -> tuple[float, float]:
    """(accuracy, cross-entropy loss) of the global model on ``test``, after static BN on ``calibration``."""
    model = strategy.global_model()
    strategy.load_norm_statistics(calibrate_batchnorm(model, calibration))
    model.eval()
    x, y = test
    logits = torch.cat([model(batch) for batch in x.split(512)])
    return float((logits.argmax(1) == y).float().mean()) if len(y) else 0.0, float(F.cross_entropy(logits, y))


def personalized_accuracy(reported: Iterable[float | None]) -> float | None:
    """Mean of the devices' own accuracies; None when no device reported one."""
    values = [value for value in reported if value is not None]
    return sum(values) / len(values) if values else None


def federated_evaluation(reported: Iterable[ReceivedEvaluation | None]) -> tuple[float, float] | None:
    """(accuracy, loss) over the devices' test samples together; None when no device reported one."""
    values = [value for value in reported if value is not None]
    samples = sum(value.samples for value in values)
    if not samples:
        return None
    accuracy = sum(value.accuracy * value.samples for value in values) / samples
    loss = sum(value.loss * value.samples for value in values) / samples
    return min(1.0, accuracy), loss


__all__ = ["accuracy", "calibrate_batchnorm", "evaluate_global", "federated_evaluation", "personalized_accuracy"]
