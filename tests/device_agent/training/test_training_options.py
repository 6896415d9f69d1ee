"""Every training option of fleet.yaml reaches the device in its assignment and changes what it trains.

The path is the real one: fleet.yaml's ``training`` section -> ``Training.for_device`` -> the
``Assignment`` message encoded and parsed as on the wire -> ``train_local`` on a client program.
"""

from __future__ import annotations

import math

import pytest
import torch

from coordinator.config.fleet import parse_fleet
from device_agent.clients import build_program
from device_agent.clients.spec import FedHMSpec, ModelSpec, TrainConfig, WidthSpec
from device_agent.layers.hybrid import hybrid
from device_agent.models import build_model
from device_agent.training.optimizer import make_optimizer, train_local
from device_agent.training.sgd import SGD
from device_agent.wire.messages import Assignment, encode, parse_message

CNN = ModelSpec("cnn", 10, 1, 8)
WIDTH = WidthSpec(strategy="fedavg", model=CNN, level=1.0, scaler=False, send_classes=False)


def fleet(training: dict, overrides: dict) -> dict:
    return {
        "fleet": "f",
        "transport": {"broker": {"mode": "managed"}},
        "model": {"arch": "cnn"},
        "dataset": {"name": "digits"},
        "training": training,
        "devices": [{"id": "d1", "profile": "raspberry-pi-5", "overrides": overrides}],
    }


def delivered(training: dict, seed: int = 11, overrides: dict | None = None) -> TrainConfig:
    """What the device parses out of the assignment the coordinator sends for this fleet.yaml."""
    loaded = parse_fleet(fleet(training, overrides or {}))
    train = loaded.training.for_device(loaded.devices[0], seed)
    message = Assignment(run="r", round=1, deadline_s=5, download="0" * 32, spec=WIDTH, train=train)
    parsed = parse_message(encode(message))
    assert isinstance(parsed, Assignment)
    return parsed.train


def program():
    torch.manual_seed(0)
    return build_program(WIDTH, build_model("cnn", 10, 1).state_dict())


def data(n: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return torch.randn(n, 1, 8, 8, generator=gen), torch.randint(0, 10, (n,), generator=gen)


def test_every_option_arrives_on_the_device_with_per_device_overrides() -> None:
    train = delivered(
        {
            "optimizer": "momentum",
            "lr": 0.2,
            "momentum": 0.5,
            "weight_decay": 1e-3,
            "local_epochs": 3,
            "batch_size": 16,
            "mask_absent_classes": False,
        },
        overrides={"batch_size": 7},
    )
    assert train == TrainConfig(
        optimizer="momentum",
        lr=0.2,
        momentum=0.5,
        weight_decay=1e-3,
        epochs=3,
        batch_size=7,  # the device's override wins
        seed=11,
        mask_absent_classes=False,
    )


@pytest.mark.parametrize(
    ("optimizer", "kind", "momentum"),
    [("sgd", SGD, 0.0), ("momentum", SGD, 0.9), ("adam", torch.optim.Adam, None)],
)
def test_the_optimizer_is_the_one_asked_for(optimizer: str, kind: type, momentum: float | None) -> None:
    train = delivered({"optimizer": optimizer, "weight_decay": 2e-3})
    made = make_optimizer(program(), train)
    assert type(made) is kind
    assert all(group["weight_decay"] == 2e-3 for group in made.param_groups)
    if momentum is not None:
        assert all(group["momentum"] == momentum for group in made.param_groups)


def test_momentum_is_refused_for_an_optimizer_without_it() -> None:
    with pytest.raises(ValueError, match="momentum only applies to optimizer 'momentum'"):
        delivered({"optimizer": "adam", "momentum": 0.5})


def test_learning_rate_scales_the_step() -> None:
    moved = {}
    for lr in (0.01, 0.04):
        prog = program()
        before = prog.model.fc.weight.detach().clone()
        train_local(prog, data(8), delivered({"optimizer": "sgd", "lr": lr, "weight_decay": 0, "batch_size": 8}))
        moved[lr] = (prog.model.fc.weight.detach() - before).norm()
    assert float(moved[0.04] / moved[0.01]) == pytest.approx(4.0, rel=1e-3)


def test_weight_decay_pulls_weights_towards_zero() -> None:
    norms = {}
    for decay in (0.0, 0.5):
        prog = program()
        train_local(prog, data(8), delivered({"optimizer": "sgd", "lr": 0.1, "weight_decay": decay, "batch_size": 8}))
        norms[decay] = float(prog.model.fc.weight.detach().norm())
    assert norms[0.5] < norms[0.0] * 0.97


def test_momentum_changes_the_trajectory() -> None:
    finals = []
    for momentum in (0.0, 0.9):
        prog = program()
        train_local(prog, data(), delivered({"lr": 0.05, "momentum": momentum, "local_epochs": 2}))
        finals.append(prog.model.fc.weight.detach().clone())
    assert not torch.allclose(finals[0], finals[1])


def test_epochs_and_batch_size_set_the_number_of_steps() -> None:
    train = delivered({"local_epochs": 3, "batch_size": 6})
    result = train_local(program(), data(20), train)
    assert result.steps == 3 * math.ceil(20 / 6)


def test_the_seed_fixes_the_shuffle() -> None:
    def final(seed: int) -> torch.Tensor:
        prog = program()
        train_local(prog, data(), delivered({"batch_size": 4}, seed=seed))
        return prog.model.fc.weight.detach().clone()

    assert torch.equal(final(3), final(3))
    assert not torch.equal(final(3), final(4))


def test_frobenius_decay_of_the_fedhm_spec_shrinks_the_factors() -> None:
    norms = {}
    for decay in (0.0, 0.5):
        spec = FedHMSpec(strategy="fedhm", model=CNN, level=0.5, frobenius_decay=decay, send_classes=False)
        torch.manual_seed(0)
        prog = build_program(spec, hybrid("cnn", 0.5, 10, 1).state_dict())
        train_local(prog, data(8), delivered({"optimizer": "sgd", "lr": 0.1, "weight_decay": 0, "batch_size": 8}))
        norms[decay] = float(prog.model.conv2.reduce.detach().norm())
    assert norms[0.5] < norms[0.0]
