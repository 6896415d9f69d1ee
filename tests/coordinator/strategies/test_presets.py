"""``strategy.preset: paper`` in fleet.yaml: the paper's recipe fills what the file leaves out."""

from __future__ import annotations

import pytest

from coordinator.config.fleet import FleetError, parse_fleet
from coordinator.strategies.presets import PRESETS
from profiles.catalog import load_catalog

CATALOG = load_catalog()
DEVICES = [{"id": "pi5-01", "profile": "raspberry-pi-5"}]


def fleet(strategy: dict, **sections):
    return parse_fleet(
        {
            "fleet": "lab",
            "transport": {"broker": {"mode": "managed"}},
            "devices": DEVICES,
            "strategy": strategy,
            **sections,
        },
        CATALOG,
    )


def test_the_fedhm_paper_preset_sets_its_recipe():
    parsed = fleet({"name": "fedhm", "preset": "paper"})
    training = parsed.training
    assert (training.optimizer, training.lr, training.local_epochs, training.batch_size) == ("momentum", 0.1, 10, 64)
    assert training.weight_decay == 5e-4
    assert parsed.strategy.params["frobenius_decay"] == 1e-4


def test_explicit_keys_override_the_preset():
    parsed = fleet(
        {"name": "fedhm", "preset": "paper", "params": {"frobenius_decay": 3e-4}},
        training={"lr": 0.02, "optimizer": "sgd"},
    )
    assert parsed.training.lr == 0.02 and parsed.training.optimizer == "sgd"
    assert parsed.training.local_epochs == 10
    assert parsed.strategy.params["frobenius_decay"] == 3e-4


def test_factorized_fl_paper_preset_leaves_min_peers_to_the_fleet():
    parsed = fleet({"name": "factorized_fl", "preset": "paper"}, ratios=[1])
    assert (parsed.training.lr, parsed.training.batch_size, parsed.training.local_epochs) == (1e-3, 256, 5)
    assert parsed.strategy.params["lambda_sparsity"] == 5e-4
    assert parsed.strategy.params["min_peers"] == 0


def test_without_a_preset_the_defaults_stay():
    parsed = fleet({"name": "fedhm"})
    assert (parsed.training.lr, parsed.training.local_epochs, parsed.training.batch_size) == (0.05, 1, 32)
    assert parsed.strategy.params == {}


@pytest.mark.parametrize(
    ("strategy", "message"),
    [
        ({"name": "fedhm", "preset": "papr"}, r"strategy\.preset: .*unknown preset 'papr'; choose one of: paper"),
        ({"name": "heterofl", "preset": "paper"}, r"strategy\.preset: .*no 'paper' preset for strategy 'heterofl'"),
    ],
)
def test_a_preset_that_does_not_exist_is_named(strategy, message):
    with pytest.raises(FleetError, match=message):
        fleet(strategy)


@pytest.mark.parametrize("strategy", sorted(PRESETS["paper"]))
def test_every_paper_preset_is_a_valid_fleet_and_lands_as_written(strategy):
    sections = {"ratios": [1]} if strategy.startswith("factorized_fl") else {}
    if strategy in ("fedlora", "lora_homogeneous"):
        sections["model"] = {"arch": "vit_tiny"}
    parsed = fleet({"name": strategy, "preset": "paper"}, **sections)
    preset = PRESETS["paper"][strategy]
    for key, value in preset.training.items():
        assert getattr(parsed.training, key) == value
    for key, value in preset.params.items():
        assert parsed.strategy.params[key] == value
