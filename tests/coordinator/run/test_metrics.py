"""metrics.jsonl rows: a round may have no server figure, and federated figures need devices that reported them."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from coordinator.run.metrics import DeviceRoundMetrics, RoundMetrics, received_metrics, round_scores
from device_agent.wire.protocol import ReceivedEvaluation


def device(received: ReceivedEvaluation | None, local_accuracy: float | None = None) -> DeviceRoundMetrics:
    return DeviceRoundMetrics(
        device_class="raspberry-pi-5",
        ratio=0.5,
        bytes_up=10,
        bytes_down=10,
        payload_bytes=8,
        status="accepted",
        local_accuracy=local_accuracy,
        **received_metrics(received),
    )


def row(round_: int, devices: dict[str, DeviceRoundMetrics], **figures: float | None) -> RoundMetrics:
    return RoundMetrics(
        round=round_, participants=len(devices), bytes_up=20, bytes_down=20, seconds=1.0, devices=devices, **figures
    )


def test_a_round_without_server_evaluation_carries_the_devices_figures() -> None:
    metrics = row(2, {"pi": device(ReceivedEvaluation(0.8, 0.6, 50))}, federated_accuracy=0.8, federated_loss=0.6)

    assert metrics.accuracy is None and metrics.loss is None
    assert RoundMetrics.model_validate_json(metrics.model_dump_json()) == metrics
    assert metrics.devices["pi"].eval_samples == 50


def test_federated_accuracy_without_a_device_that_reported_it_is_refused() -> None:
    with pytest.raises(ValidationError, match="no device reported a global_accuracy"):
        row(1, {"pi": device(None)}, federated_accuracy=0.8, federated_loss=0.6)
    with pytest.raises(ValidationError, match="accuracy and loss are set together"):
        row(1, {"pi": device(None)}, accuracy=0.8)


def test_best_round_scores_prefer_the_devices_own_accuracy_then_the_servers() -> None:
    rounds = [
        row(1, {"pi": device(None, local_accuracy=0.7)}, personalized_accuracy=0.7, accuracy=0.5, loss=1.0),
        row(2, {"pi": device(None)}, accuracy=0.6, loss=0.9),
        row(3, {"pi": device(ReceivedEvaluation(0.9, 0.3, 50))}, federated_accuracy=0.9, federated_loss=0.3),
    ]
    assert round_scores(rounds) == {1: 0.7, 2: 0.6}
