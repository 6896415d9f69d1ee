"""The strategy <-> client contract (``coordinator.emulation.contract``), for every registered strategy.

One registry entry pairs a server strategy with its client program (``Strategy.program``); the
program names the spec it consumes. Here each strategy's assignment travels as the wire does (the
spec inside an ``Assignment`` message, the tensors as safetensors), the device builds the program
from what it parsed, trains, and the server folds the upload back.
"""

from __future__ import annotations

import pytest

from coordinator.emulation.contract import CNN, check_contract, contract_levels
from coordinator.strategies import STRATEGIES, ModelSpec
from coordinator.strategies.levels import LevelScale
from device_agent.clients import PROGRAMS
from device_agent.clients.spec import spec_types, strategies_of

VIT = ModelSpec("vit_tiny", 4, 1, 8)
FINE_TUNING = {"fedlora", "lora_homogeneous", "hetlora", "flora", "ft"}
"""Strategies that fine-tune a pre-trained transformer: they run on the ViT."""


def test_every_strategy_has_the_program_registered_for_its_name_and_every_program_a_strategy() -> None:
    for name, strategy in STRATEGIES.items():
        assert PROGRAMS[name] is strategy.program, name
        assert name in strategies_of(strategy.program.Spec), f"{name}: its program's spec does not accept the name"
    assert set(PROGRAMS) == set(STRATEGIES)
    assert len(spec_types()) == len({program.Spec for program in PROGRAMS.values()})


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_assignment_over_the_wire_trains_and_folds_back(name: str) -> None:
    check_contract(name, VIT if name in FINE_TUNING else CNN)


def test_the_contract_check_takes_a_level_scale_it_has_never_heard_of(monkeypatch) -> None:
    # A plugin's own scale (here "depth", sizing models like width) keyed nothing: the check asks the scale.
    depth = LevelScale("depth", True, False, lambda level: f"depth {level:g}")
    monkeypatch.setattr(STRATEGIES["heterofl"], "levels", depth)
    assert contract_levels("heterofl") == (1.0, 0.5)
    check_contract("heterofl")
