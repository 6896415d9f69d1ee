"""A strategy's client model and transfer sizes are exactly what its client program builds and sends.

The planner sizes devices from ``Strategy.client_model`` / ``download_bytes`` / ``upload_bytes``
without a strategy instance; these tests build real strategies, run a real ``configure`` and the
device's program, and compare.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from coordinator.emulation.contract import contract_levels
from coordinator.planning.model_stats import model_stats
from coordinator.strategies import STRATEGIES, ClientSlot, ModelSpec, build_strategy
from device_agent.clients import build_program

DIGITS = ModelSpec("cnn", 10, 1, 8)
VIT = ModelSpec("vit_tiny", 10, 1, 8)
FINE_TUNING = {"fedlora", "lora_homogeneous", "hetlora", "flora", "ft"}
LEVELS = {"rank": (1.0, 0.5, 0.125), "width": (1.0, 0.5, 0.25), "none": (1.0,)}
"""More levels for the built-in scales; a plugin's own scale gets the contract check's (it raised KeyError)."""
CASES = [
    (name, level)
    for name, cls in STRATEGIES.items()
    for level in (LEVELS[cls.levels.name] if cls.levels.name in LEVELS else contract_levels(name))
]


def _shapes(model: nn.Module) -> dict[str, tuple[tuple[int, ...], bool]]:
    return {
        **{k: (tuple(p.shape), p.requires_grad) for k, p in model.named_parameters()},
        **{k: (tuple(b.shape), False) for k, b in model.named_buffers()},
    }


def _bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.parametrize(("name", "level"), CASES)
def test_client_model_and_transfers_match_the_program_of_a_real_assignment(name: str, level: float) -> None:
    cls = STRATEGIES[name]
    model = VIT if name in FINE_TUNING else DIGITS
    strategy = build_strategy(name, model)
    [assignment] = strategy.configure(1, [ClientSlot("c0", level, 50)]).values()
    program = build_program(assignment.spec, assignment.tensors)

    planned = cls.client_model(model, strategy.params, level)

    assert next(planned.parameters()).device.type == "meta"
    assert _shapes(planned) == _shapes(program.model)
    assert cls.download_bytes(model, strategy.params, level) == _bytes(assignment.tensors)
    assert cls.upload_bytes(model, strategy.params, level) == _bytes(program.upload())


def test_fedavg_small_with_a_fixed_width_trains_that_width_whatever_the_plan() -> None:
    strategy = build_strategy("fedavg_small", DIGITS, {"level": 0.5})
    slot = ClientSlot("c0", 1.0, 50)
    [assignment] = strategy.configure(1, [slot]).values()
    program = build_program(assignment.spec, assignment.tensors)

    planned = strategy.client_model(DIGITS, strategy.params, slot.level)

    assert _shapes(planned) == _shapes(program.model)
    assert strategy.trained_level(slot) == 0.5
    assert strategy.level_label(strategy.params, 1.0) == "width 0.5 (fixed)"


def test_trained_level_is_the_slot_level_unless_the_strategy_overrides_the_width() -> None:
    slot = ClientSlot("c0", 0.25, 50)

    assert build_strategy("fedhm", DIGITS).trained_level(slot) == 0.25
    assert build_strategy("heterofl", DIGITS).trained_level(slot) == 0.25
    assert build_strategy("fedavg", DIGITS).trained_level(slot) == 1.0


def test_levels_are_named_by_what_they_mean_to_the_strategy() -> None:
    def label(name: str, level: float) -> str:
        cls = STRATEGIES[name]
        return cls.level_label(cls.Params(), level)

    assert label("fedhm", 0.25) == "gamma 1/4"
    assert label("heterofl", 0.5) == "width 0.5"
    assert label("factorized_fl", 1.0) == "full model"


def test_levels_a_strategy_rejects_are_explained() -> None:
    assert STRATEGIES["fedhm"].level_problem(0.25) is None
    assert STRATEGIES["heterofl"].level_problem(1.5) == "a width level must be in (0, 1]"
    assert STRATEGIES["factorized_fl"].level_problem(1.0) is None
    assert "no size levels" in (STRATEGIES["factorized_fl"].level_problem(0.5) or "")


def test_fedhm_uploads_what_the_model_statistics_count() -> None:
    resnet = ModelSpec("resnet18", 10, 3, 32)
    params = STRATEGIES["fedhm"].Params()

    assert STRATEGIES["fedhm"].upload_bytes(resnet, params, 0.25) == model_stats("resnet18", 0.25).upload_bytes


def test_the_three_strategies_give_different_models_at_the_same_level() -> None:
    resnet = ModelSpec("resnet18", 10, 3, 32)

    def params(name: str) -> int:
        cls = STRATEGIES[name]
        model = cls.client_model(resnet, cls.Params(), 0.125 if cls.levels != "none" else 1.0)
        return sum(p.numel() for p in model.parameters() if p.requires_grad)

    fedhm, heterofl, dense = params("fedhm"), params("heterofl"), params("fedavg")
    assert heterofl < fedhm < dense
    assert params("factorized_fl") > dense, "u, v and a dense-shaped mu per layer"
