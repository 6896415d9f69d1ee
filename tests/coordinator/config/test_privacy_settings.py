"""fleet.yaml ``privacy``: what it accepts, and why it refuses a strategy or a setting."""

from __future__ import annotations

import pytest

from coordinator.config.fleet import FleetError, parse_fleet
from coordinator.privacy.settings import Clip
from profiles.catalog import load_catalog

CATALOG = load_catalog()
FLEET = {
    "fleet": "lab",
    "transport": {"broker": {"mode": "managed"}},
    "strategy": {"name": "fedavg"},
    "devices": [{"id": f"pi-{i}", "profile": "raspberry-pi-5"} for i in range(4)],
}


def fleet(privacy, strategy=None):
    return parse_fleet({**FLEET, "strategy": strategy or FLEET["strategy"], "privacy": privacy}, CATALOG)


def test_a_number_is_a_fixed_clip_norm_and_adaptive_takes_its_quantile():
    assert fleet({"noise_multiplier": 1.1, "clip": 0.5}).privacy.clip == Clip(norm=0.5)
    adaptive = fleet({"target_epsilon": 8, "clip": {"mode": "adaptive", "quantile": 0.7}}).privacy
    assert adaptive.clip == Clip(mode="adaptive", quantile=0.7) and adaptive.budget == 8
    fedhm = {"name": "fedhm", "params": {"weighting": "uniform"}}
    assert fleet({"noise_multiplier": 1.0, "clip": 1, "budget_epsilon": 4}, fedhm).privacy.budget == 4


@pytest.mark.parametrize(
    ("privacy", "strategy", "message"),
    [
        ({"clip": 1}, None, "give exactly one of noise_multiplier or target_epsilon"),
        ({"noise_multiplier": 1, "target_epsilon": 2, "clip": 1}, None, "exactly one of"),
        ({"noise_multiplier": 1}, None, r"privacy\.clip: Field required"),
        ({"noise_multiplier": 1, "clip": -1}, None, r"privacy\.clip\.norm: Input should be greater than 0"),
        (
            {"noise_multiplier": 1, "clip": {"mode": "adaptive", "quantile": 1.5}},
            None,
            r"privacy\.clip\.quantile: Input should be less than 1",
        ),
        ({"noise_multiplier": 1, "clip": {"mode": "fixed"}}, None, "a fixed clip needs its norm"),
        ({"noise_multiplier": 1, "clip": 1, "delta": 0.5}, None, r"privacy\.delta: 0\.5 is not below 1 / 4 devices"),
        ({"noise_multiplier": 1, "clip": 1, "epsilon": 3}, None, r"privacy\.epsilon: Extra inputs are not permitted"),
        ({"noise_multiplier": 1, "clip": 1}, {"name": "heterofl"}, "cannot run with privacy: not yet: each weight is"),
        ({"noise_multiplier": 1, "clip": 1}, {"name": "factorized_fl"}, "it is personalized"),
        (
            {"noise_multiplier": 1, "clip": 1},
            {"name": "fedhm"},
            r"strategy\.params\.weighting: .*write `weighting: uniform`",
        ),
        (
            {"noise_multiplier": 1, "clip": 1},
            {"name": "fedavg", "params": {"rule": "median"}},
            "privacy needs rule: mean",
        ),
    ],
)
def test_each_refusal_says_why(privacy, strategy, message):
    with pytest.raises(FleetError, match=message):
        fleet(privacy, strategy)
