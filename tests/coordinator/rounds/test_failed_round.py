"""A round without enough accepted updates closes saying FAILED, at WARNING, in the log and the live table."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from coordinator.cli.live import round_table
from coordinator.rounds.closing import log_closed
from coordinator.run.metrics import DeviceRoundMetrics, DeviceStatus, RoundMetrics


def closed(*statuses: DeviceStatus) -> RoundMetrics:
    """Round 1 of devices d0, d1, ... with these statuses, evaluated at accuracy 0.1106."""
    devices = {
        f"d{i}": DeviceRoundMetrics(
            device_class="raspberry-pi-5", ratio=1.0, bytes_up=1, bytes_down=1, payload_bytes=1, status=status
        )
        for i, status in enumerate(statuses)
    }
    accepted = sum(s == "accepted" for s in statuses)
    figures = {"accuracy": 0.1106, "loss": 2.3, "bytes_up": 1, "bytes_down": 1, "seconds": 272.0}
    return RoundMetrics(round=1, participants=accepted, devices=devices, **figures)


def test_a_round_without_updates_closes_failed_at_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="fedfleet.engine"):
        log_closed(closed("late", "rejected"), quorum=0.8)
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert record.getMessage() == (
        "round 1 FAILED: 0/2 updates (quorum 2; 1 late, 1 rejected), accuracy 0.1106, loss 2.3000, 272.0 s"
    )


def test_a_round_below_its_quorum_fails_and_one_at_its_quorum_closes(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="fedfleet.engine"):
        log_closed(closed("accepted", "dropped", "dropped"), quorum=0.5)
        log_closed(closed("accepted", "accepted", "dropped"), quorum=0.5)
    below, met = caplog.records
    assert (below.levelno, below.getMessage()) == (
        logging.WARNING,
        "round 1 FAILED: 1/3 updates (quorum 2; 2 dropped), accuracy 0.1106, loss 2.3000, 272.0 s",
    )
    assert (met.levelno, met.getMessage()) == (
        logging.INFO,
        "round 1 closed: 2/3 updates, accuracy 0.1106, loss 2.3000, 272.0 s",
    )


def test_the_live_table_title_says_a_round_failed() -> None:
    fleet = SimpleNamespace(fleet="f", rounds=6, quorum=0.8)
    engine = SimpleNamespace(fleet=fleet, next_round=2, open=None, devices={}, last=closed("late", "late"))
    assert round_table(engine).title == (
        "fleet f: round 2/6  (round 1 FAILED: accuracy 0.111, loss 2.300, 0/2 updates, 272.0 s)"
    )
    engine.last = closed("accepted", "accepted")
    good = "fleet f: round 2/6  (round 1: accuracy 0.111, loss 2.300, 2/2 updates, 272.0 s)"
    assert round_table(engine).title == good
