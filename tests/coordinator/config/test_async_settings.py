"""fleet.yaml ``strategy.mode: async``: FedBuff's settings, validated with key paths; strategies that cannot run
async are refused with the reason."""

from __future__ import annotations

import copy

import pytest

from coordinator.config.asynchronous import SUPPORTED, WHY_NOT, StalenessWeight
from coordinator.config.fleet import FleetError, parse_fleet
from coordinator.strategies import STRATEGIES

FLEET = {
    "fleet": "lab",
    "transport": {"broker": {"mode": "managed"}},
    "strategy": {"name": "fedhm", "mode": "async", "async": {"buffer": 4, "server_lr": 0.5, "max_staleness": 6}},
    "devices": [{"id": "nano-01", "profile": "jetson-nano"}, {"id": "pi5-01", "profile": "raspberry-pi-5"}],
}


def _fleet(**strategy: object) -> dict:
    data = copy.deepcopy(FLEET)
    data["strategy"].update(strategy)
    return data


def test_async_mode_reads_its_settings_and_defaults_the_staleness_weight_to_fedbuffs() -> None:
    settings = parse_fleet(FLEET).strategy.asynchronous
    assert settings is not None
    assert (settings.buffer, settings.server_lr, settings.max_staleness, settings.concurrency) == (4, 0.5, 6, None)
    assert settings.staleness_weight(3) == pytest.approx(0.5)  # 1 / sqrt(1 + 3)


def test_mode_async_alone_takes_the_default_settings_and_sync_is_the_default_mode() -> None:
    data = _fleet()
    del data["strategy"]["async"]
    assert parse_fleet(data).strategy.asynchronous.buffer == 10
    assert parse_fleet({**FLEET, "strategy": {"name": "fedhm"}}).strategy.mode == "sync"


@pytest.mark.parametrize(
    ("strategy", "message"),
    [
        ({"async": {"buffer": 0}}, "strategy.async.buffer"),
        ({"async": {"max_staleness": -1}}, "strategy.async.max_staleness"),
        ({"async": {"bufer": 3}}, "strategy.async.bufer"),
        ({"async": {"staleness_weight": {"rule": "hinge"}}}, "strategy.async.staleness_weight.rule"),
        ({"mode": "asynch"}, "strategy.mode"),
        ({"mode": "sync"}, "async: only applies with `mode: async`"),
    ],
)
def test_each_mistake_names_its_key_path(strategy: dict, message: str) -> None:
    with pytest.raises(FleetError, match=message.replace(".", r"\.").replace("`", ".")):
        parse_fleet(_fleet(**strategy))


@pytest.mark.parametrize("name", sorted(set(STRATEGIES) - SUPPORTED))
def test_a_strategy_that_cannot_run_async_is_refused_with_its_reason(name: str) -> None:
    data = _fleet(name=name, params={})
    data["ratios"] = [1]
    with pytest.raises(FleetError, match=r"strategy\.mode: .* cannot run async") as error:
        parse_fleet(data)
    assert name in WHY_NOT and WHY_NOT[name] in str(error.value)


def test_async_and_secure_aggregation_are_refused_together_with_the_reason() -> None:
    data = _fleet(name="fedavg")
    data["ratios"] = [1]
    data["limits"] = {"update_bound_factor": None, "direction_min_cosine": None, "peer_min_cosine": None}
    data["secure_aggregation"] = {"threshold": 2, "neighbours": 1}
    with pytest.raises(FleetError, match=r"secure_aggregation: not with strategy\.mode async"):
        parse_fleet(data)


def test_fedhm_params_that_need_a_whole_round_are_refused_in_async_mode() -> None:
    with pytest.raises(FleetError, match=r"strategy\.params\.global_as_pseudo_client"):
        parse_fleet(_fleet(params={"global_as_pseudo_client": True}))


def test_staleness_weights_polynomial_and_constant() -> None:
    fedbuff = StalenessWeight()
    assert [fedbuff(s) for s in (0, 3, 8)] == pytest.approx([1.0, 0.5, 1 / 3])
    assert StalenessWeight(rule="polynomial", exponent=1)(4) == pytest.approx(0.2)
    assert StalenessWeight(rule="constant")(50) == 1.0
    with pytest.raises(ValueError, match="staleness must be >= 0"):
        fedbuff(-1)
