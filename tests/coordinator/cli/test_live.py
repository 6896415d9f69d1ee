"""The live table's title shows whichever figures a round has: the server's, the devices' federated ones, both."""

from __future__ import annotations

from coordinator.cli.live import round_figures
from coordinator.run.metrics import DeviceRoundMetrics, RoundMetrics


def closed_round(**figures: float) -> RoundMetrics:
    device = DeviceRoundMetrics(
        device_class="raspberry-pi-5",
        ratio=1.0,
        bytes_up=1,
        bytes_down=1,
        payload_bytes=1,
        status="accepted",
        global_accuracy=figures.get("federated_accuracy"),
        global_loss=figures.get("federated_loss"),
        eval_samples=40 if "federated_accuracy" in figures else None,
    )
    return RoundMetrics(
        round=1, participants=1, bytes_up=1, bytes_down=1, seconds=1.0, devices={"pi": device}, **figures
    )


def test_a_coordinator_with_and_without_data_shows_what_it_measured() -> None:
    both = closed_round(accuracy=0.9, loss=0.3, federated_accuracy=0.85, federated_loss=0.4)
    assert round_figures(both) == "accuracy 0.900, loss 0.300, federated accuracy 0.850"
    assert round_figures(closed_round(federated_accuracy=0.85, federated_loss=0.4)) == "federated accuracy 0.850"
    assert round_figures(closed_round()) == "not evaluated"
