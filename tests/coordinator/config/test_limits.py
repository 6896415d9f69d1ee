"""fleet.yaml ``limits``: today's bounds by default, and what an operator sets reaches the guard, gate and engine."""

from __future__ import annotations

from dataclasses import replace

import pytest

from coordinator.config.fleet import FleetError, parse_fleet
from coordinator.config.limits import GateSettings
from coordinator.rounds.engine import EngineSettings
from device_agent.wire.guard import InboundLimits
from tests.coordinator.config.test_fleet import CATALOG, MINIMAL

TUNED = {
    "max_upload_bytes": "256 MiB",
    "messages_per_s": 20,
    "message_burst": 50,
    "max_open_transfers": 2,
    "norm_bound_factor": 25,
    "rejected_grace_s": 30,
    "resend_after_s": 12.5,
}


def test_a_fleet_without_limits_runs_with_the_bounds_the_code_always_had_but_uploads_sized_to_its_model() -> None:
    fleet = parse_fleet(MINIMAL, CATALOG)

    most = fleet.inbound_limits().max_transfer_bytes
    assert replace(fleet.inbound_limits(), max_transfer_bytes=1 << 30, max_pending_bytes=1 << 30) == InboundLimits()
    assert fleet.inbound_limits().max_pending_bytes == most
    assert EngineSettings.of(fleet, min_devices=2, wait_timeout_s=60) == EngineSettings(
        min_devices=2, wait_timeout_s=60, gate=GateSettings()
    )


def test_tuned_limits_reach_the_transport_guard_the_upload_gate_and_the_engine() -> None:
    fleet = parse_fleet({**MINIMAL, "limits": TUNED}, CATALOG)

    inbound = fleet.inbound_limits()
    assert (inbound.max_transfer_bytes, inbound.max_pending_bytes) == (256 << 20, 256 << 20)
    assert (inbound.messages_per_s, inbound.burst, inbound.max_open_transfers) == (20, 50, 2)
    settings = EngineSettings.of(fleet, min_devices=1, wait_timeout_s=60)
    assert settings.gate.max_norm_ratio == 25
    assert (settings.rejected_grace_s, settings.resend_after_s) == (30, 12.5)


@pytest.mark.parametrize(
    ("model", "secure", "expected_mib"),
    [("cnn", False, 16), ("resnet18", False, 171), ("resnet18", True, 341)],
)
def test_the_default_upload_bound_is_four_times_the_largest_model_the_strategy_moves(
    model: str, secure: bool, expected_mib: int
) -> None:
    raw = {**MINIMAL, "strategy": {"name": "fedavg"}, "model": {"arch": model, "num_classes": 10}}
    if secure:
        devices = [{"id": f"pi5-0{i}", "profile": "raspberry-pi-5"} for i in range(3)]
        screening = dict.fromkeys(["update_bound_factor", "peer_min_cosine", "peer_hard_floor"])
        raw |= {"devices": devices, "limits": screening, "secure_aggregation": {"threshold": 2, "neighbours": 2}}
    inbound = parse_fleet(raw, CATALOG).inbound_limits()

    assert round(inbound.max_transfer_bytes / 2**20) == expected_mib  # ResNet-18: 4 x 42.7 MB of float32 weights
    assert inbound.max_pending_bytes == inbound.max_transfer_bytes


def test_the_norm_bound_can_be_turned_off() -> None:
    fleet = parse_fleet({**MINIMAL, "limits": {"norm_bound_factor": None}}, CATALOG)

    assert fleet.limits.gate().max_norm_ratio is None


def test_the_update_bound_is_on_by_default_and_each_setting_is_checked_by_name() -> None:
    gate = parse_fleet(MINIMAL, CATALOG).limits.gate()
    assert (gate.update_bound_factor, gate.update_bound_action, gate.sample_weight_factor) == (3.0, "clip", 2.0)

    tuned = {"update_bound_factor": 5, "update_bound_action": "refuse", "sample_weight_factor": None}
    gate = parse_fleet({**MINIMAL, "limits": tuned}, CATALOG).limits.gate()
    assert (gate.update_bound_factor, gate.update_bound_action, gate.sample_weight_factor) == (5, "refuse", None)

    for key, value in (("update_bound_action", "drop"), ("update_bound_factor", 0.5), ("sample_weight_factor", 0)):
        with pytest.raises(FleetError, match=f"limits.{key}"):
            parse_fleet({**MINIMAL, "limits": {key: value}}, CATALOG)


def test_the_peer_check_judges_agreeing_rounds_by_its_floor_and_every_round_by_the_hard_floor() -> None:
    gate = parse_fleet(MINIMAL, CATALOG).limits.gate()
    assert (gate.peer_min_cosine, gate.peer_min_agreement, gate.peer_spread, gate.peer_hard_floor) == (
        -0.2,
        0.2,
        0.0,
        -0.35,
    )
    gate = parse_fleet({**MINIMAL, "limits": {"peer_min_agreement": None}}, CATALOG).limits.gate()
    assert gate.peer_min_agreement is None  # every round judged by the floor, as before 2026-11-29
    with pytest.raises(FleetError, match=r"limits\.peer_min_agreement"):
        parse_fleet({**MINIMAL, "limits": {"peer_min_agreement": 1.5}}, CATALOG)
    with pytest.raises(ValueError, match="peer_min_agreement"):
        GateSettings(peer_min_agreement=-2)
