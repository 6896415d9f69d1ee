"""fleet.yaml ``secure_aggregation``: accepted for FedAvg without screening, refused with the key and the reason."""

from __future__ import annotations

import pytest

from benchmarks.screening import OFF
from coordinator.config.fleet import FleetError, parse_fleet
from coordinator.config.secure import WHY_NOT
from profiles.catalog import load_catalog

CATALOG = load_catalog()


def fleet(devices: int = 5, **settings: object) -> dict:
    return {
        "fleet": "lab",
        "transport": {"broker": {"mode": "managed"}},
        "strategy": {"name": "fedavg"},
        "ratios": [1],
        "limits": dict(OFF),
        "devices": [{"id": f"dev-{i}", "profile": "raspberry-pi-5"} for i in range(devices)],
        "secure_aggregation": {"threshold": 3, "neighbours": 4},
        **settings,
    }


def refusal(data: dict) -> str:
    with pytest.raises(FleetError) as caught:
        parse_fleet(data, CATALOG)
    return str(caught.value)


def test_fedavg_without_screening_runs_under_secure_aggregation() -> None:
    parsed = parse_fleet(fleet(), CATALOG)

    assert parsed.secure_aggregation is not None
    assert (parsed.secure_aggregation.threshold, parsed.secure_aggregation.neighbours) == (3, 4)
    assert (parsed.secure_aggregation.clip, parsed.secure_aggregation.bits) == (0.5, 16)
    plain = {k: v for k, v in fleet().items() if k != "secure_aggregation"}
    assert parse_fleet(plain, CATALOG).secure_aggregation is None


@pytest.mark.parametrize("name", ["simfed", "fedfac", "flora", "factorized_fl"])
def test_a_strategy_whose_aggregate_is_not_a_sum_of_uploads_is_refused_by_name(name: str) -> None:
    message = refusal({k: v for k, v in fleet(strategy={"name": name}).items() if k != "ratios"})

    assert "secure_aggregation" in message and f"{name!r} does not run under secure aggregation: " in message
    assert WHY_NOT[name].split(":")[0] in message  # its own reason


@pytest.mark.parametrize("name", ["heterofl", "fedrolex", "fedhm", "fedavg_small"])
def test_width_slices_and_fedhm_s_dense_updates_run_under_secure_aggregation(name: str) -> None:
    assert parse_fleet(fleet(strategy={"name": name}, ratios=[1, 0.5]), CATALOG).secure_aggregation is not None


@pytest.mark.parametrize(
    ("strategy", "key"),
    [
        ({"name": "fedavg", "params": {"rule": "median"}}, "rule"),
        ({"name": "fedhm", "params": {"label_masked_classifier": "renormalised"}}, "label_masked_classifier"),
        ({"name": "fedhm", "params": {"global_as_pseudo_client": True}}, "global_as_pseudo_client"),
    ],
)
def test_strategy_parameters_that_need_single_updates_are_refused_at_their_key(strategy: dict, key: str) -> None:
    ratios = [1] if strategy["name"] == "fedavg" else [1, 0.5]
    assert f"strategy.params.{key}: " in refusal(fleet(strategy=strategy, ratios=ratios))


@pytest.mark.parametrize(
    "key", ["update_bound_factor", "peer_min_cosine", "peer_hard_floor", "direction_min_cosine", "update_noise"]
)
def test_screening_that_reads_single_updates_is_refused(key: str) -> None:
    message = refusal(fleet(limits={**OFF, key: 0.5 if key != "update_bound_factor" else 1.5}))

    assert f"limits: {key} read each device's update" in message and "set them to null" in message


def test_the_default_limits_screen_and_are_refused_too() -> None:
    message = refusal({k: v for k, v in fleet().items() if k != "limits"})

    assert "update_bound_factor, peer_min_cosine, peer_hard_floor read each device's update" in message


def test_privacy_composes_with_secure_aggregation_as_noise_the_devices_add() -> None:
    private = {"noise_multiplier": 1.0, "clip": 1.0, "delta": 1e-3}
    wide = {"threshold": 3, "neighbours": 4, "clip": 3.0}  # 6 x the noise each of 5 devices adds, 1 / sqrt(5)

    assert parse_fleet(fleet(privacy=private, secure_aggregation=wide), CATALOG).privacy is not None
    assert "clip: 0.5 does not cover the privacy noise each device adds" in refusal(fleet(privacy=private))
    adaptive = {**private, "clip": {"mode": "adaptive"}}
    assert "privacy.clip: adaptive clipping counts the devices" in refusal(fleet(privacy=adaptive))
    fedhm = fleet(
        privacy=private, secure_aggregation=wide, strategy={"name": "fedhm", "params": {"weighting": "uniform"}}
    )
    assert "distributed noise under secure aggregation is wired for fedavg only" in refusal(fedhm)


@pytest.mark.parametrize(
    ("settings", "devices", "problem"),
    [
        ({"threshold": 3, "neighbours": 5}, 5, "neighbours: must be in 2..4"),
        ({"threshold": 3, "neighbours": 3}, 6, "neighbours: must be even"),
        ({"threshold": 5, "neighbours": 4}, 5, "threshold: must be in 2..4"),
        ({"threshold": 2, "neighbours": 2}, 2, "secure aggregation needs at least"),
        ({"threshold": 3, "neighbours": 4, "bits": 40}, 5, "less than or equal to 32"),
        ({"threshold": 3, "neighbours": 4, "clip": 0}, 5, "greater than 0"),
    ],
)
def test_parameters_are_checked_against_the_round_s_size(settings: dict, devices: int, problem: str) -> None:
    message = refusal(fleet(devices, secure_aggregation=settings))

    assert "secure_aggregation" in message and problem in message


def test_a_round_s_size_follows_participation() -> None:
    # 10 devices at participation 0.5: a round asks 5, so the graph's degree is at most 4.
    wide = {"threshold": 3, "neighbours": 6}
    assert "a round asks 5 devices" in refusal(fleet(10, participation=0.5, secure_aggregation=wide))
    assert parse_fleet(fleet(10, participation=0.5), CATALOG).secure_aggregation is not None
