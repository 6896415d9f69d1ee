"""metrics.jsonl rows: a round may have no server figure, and federated figures need devices that reported them."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from coordinator.cli.start import finished_run_status
from coordinator.run.metrics import DeviceRoundMetrics, RoundMetrics, failed_rounds, received_metrics, round_scores
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


def test_a_round_with_no_update_or_fewer_than_the_quorum_is_a_failed_round() -> None:
    refused = device(None).model_copy(update={"status": "rejected"})
    rounds = [
        row(1, {"a": device(None), "b": device(None)}),
        RoundMetrics(round=2, participants=0, bytes_up=0, bytes_down=0, seconds=1.0, devices={"a": refused}),
        RoundMetrics(
            round=3,
            participants=1,
            bytes_up=0,
            bytes_down=0,
            seconds=1.0,
            devices={"a": device(None), "b": refused, "c": refused},
        ),
    ]
    assert failed_rounds(rounds, quorum=0.5) == [2, 3]  # 1 of 3 is below a quorum of 2
    assert failed_rounds(rounds, quorum=0.3) == [2]


def test_a_finished_run_with_failed_rounds_says_which_and_returns_1(capsys: pytest.CaptureFixture[str]) -> None:
    empty = RoundMetrics(round=2, participants=0, bytes_up=0, bytes_down=0, seconds=1.0)
    assert finished_run_status([row(1, {"a": device(None)}), empty], quorum=0.8) == 1
    said = capsys.readouterr().err
    assert "coordinator: 1 of 2 rounds failed" in said and "the quorum, 80% of the devices asked" in said
    assert finished_run_status([row(1, {"a": device(None)})], quorum=0.8) == 0
    assert capsys.readouterr().out == "all rounds done\n"
