"""A new strategy is two modules and nothing else: FedProx, installed as a plugin through entry points.

The plugin is a throwaway distribution written into a temporary folder: a server module (FedAvg's
rule under its own name, with a ``mu`` parameter), a client module (its spec beside its program,
which adds mu/2 ||w - w_received||^2 to the loss) and a ``*.dist-info`` whose entry points name them
in the ``fedfleet.strategies`` and ``fedfleet.clients`` groups. No fedfleet file is edited: the
registries find it, the contract check passes, ``coordinator plan`` plans it and it simulates.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from coordinator.cli.app import main as coordinator
from coordinator.emulation.contract import check_contract
from coordinator.emulation.simulation import SimClient, simulate
from coordinator.strategies import STRATEGIES, ModelSpec, build_strategy
from device_agent.clients import PROGRAMS
from device_agent.clients.spec import parse_spec
from device_agent.common.registry import Registry, RegistryError
from device_agent.data.datasets import load_dataset
from device_agent.data.partition import PartitionSpec, client_shard
from device_agent.training.optimizer import TrainConfig
from tests.plugins import installed_plugin

NAME = "fedprox_test"

CLIENT = '''
"""FedProx's device side: the dense program plus the proximal term to the weights it received."""
from typing import ClassVar, Literal

import torch
from pydantic import Field

from device_agent.clients.spec import WidthSpec
from device_agent.clients.width import WidthProgram


class FedProxSpec(WidthSpec):
    strategy: Literal["fedprox_test"]
    mu: float = Field(ge=0)


class FedProxProgram(WidthProgram):
    Spec: ClassVar[type[FedProxSpec]] = FedProxSpec

    def __init__(self, spec, tensors, local=None):
        super().__init__(spec, tensors, local)
        self.received = {k: p.detach().clone() for k, p in self.model.named_parameters()}

    def regularizer(self):
        drift = sum(((p - self.received[k]) ** 2).sum() for k, p in self.model.named_parameters())
        return self.spec.mu / 2 * drift
'''

SERVER = '''
"""FedProx's server side: FedAvg's sample-weighted average, with mu for its clients."""
from typing import ClassVar

from pydantic import Field

from coordinator.strategies.width import FedAvg, FedAvgParams
from fedprox_client import FedProxProgram


class FedProxParams(FedAvgParams):
    mu: float = Field(0.01, ge=0, description="weight of the proximal term")


class FedProx(FedAvg):
    name: ClassVar[str] = "fedprox_test"
    Params: ClassVar[type[FedProxParams]] = FedProxParams
    program: ClassVar[type[FedProxProgram]] = FedProxProgram

    def spec_fields(self):
        return {"mu": self.params.mu}
'''


@pytest.fixture
def fedprox_plugin(tmp_path: Path) -> Iterator[None]:
    """Install the two-module plugin on sys.path with real entry points; take it away afterwards."""
    entry_points = {"fedfleet.strategies": {NAME: "fedprox_server"}, "fedfleet.clients": {NAME: "fedprox_client"}}
    modules = {"fedprox_client": CLIENT, "fedprox_server": SERVER}
    with installed_plugin(tmp_path, "fedprox-plugin", entry_points, modules):
        try:
            STRATEGIES.reload()
            PROGRAMS.reload()
            yield
        finally:
            STRATEGIES.unregister(NAME)
            PROGRAMS.unregister(NAME)


@pytest.mark.slow
def test_a_plugin_strategy_passes_the_contract_plans_and_simulates(fedprox_plugin, tmp_path: Path, capsys) -> None:
    assert NAME in STRATEGIES and PROGRAMS[NAME] is STRATEGIES[NAME].program
    spec = parse_spec({"strategy": NAME, "model": ModelSpec("cnn", 10, 1, 8), "level": 1.0, "mu": 0.5,
                       "scaler": False, "send_classes": False})  # fmt: skip
    assert type(spec).__name__ == "FedProxSpec" and spec.mu == 0.5

    check_contract(NAME)

    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(
        "fleet: prox\nbroker: {mode: managed}\nmodel: {arch: cnn, num_classes: 10}\n"
        f"dataset: {{name: digits}}\nstrategy: {{name: {NAME}, params: {{mu: 0.1}}}}\n"
        "devices:\n  - {id: pi-1, profile: raspberry-pi-5}\n  - {id: orin-1, profile: jetson-orin-nano-8gb}\n"
    )
    assert coordinator(["plan", "--fleet", str(fleet)]) == 0
    assert "pi-1" in capsys.readouterr().out

    data = load_dataset("digits", 8, 1)
    split = PartitionSpec("iid", 2, seed=0)
    shard = lambda i: client_shard(data.train_x, data.train_y, split, i)  # noqa: E731
    test = lambda i: client_shard(data.test_x, data.test_y, split, i)  # noqa: E731
    clients = [SimClient(f"c{i}", 1.0, shard(i), test(i)) for i in range(2)]
    strategy = build_strategy(NAME, ModelSpec("cnn", 10, 1, 8), {"mu": 0.1}, seed=0)
    result = simulate(strategy, clients, 2, TrainConfig(epochs=1), (data.test_x, data.test_y), data.train_x[:128])
    assert [r.round for r in result.rounds] == [1, 2]
    assert result.final.accuracy > 0.3


def test_the_proximal_term_pulls_training_towards_the_weights_received(fedprox_plugin) -> None:
    program_class = PROGRAMS[NAME]
    model = ModelSpec("cnn", 10, 1, 8)
    tensors = build_strategy(NAME, model, {}, seed=0).global_state()
    fields = {"strategy": NAME, "model": model, "level": 1.0, "scaler": False, "send_classes": False}
    program = program_class(parse_spec({**fields, "mu": 2.0}), tensors)
    assert float(program.regularizer().detach()) == 0.0
    with torch.no_grad():
        next(program.model.parameters()).add_(1.0)
    assert float(program.regularizer().detach()) > 0.0


def test_a_name_taken_twice_or_a_broken_plugin_is_named(tmp_path: Path) -> None:
    registry: Registry[object] = Registry("strategy", "coordinator.strategies", "fedfleet.test-broken")
    registry.register("x", int)
    with pytest.raises(RegistryError, match=r"strategy 'x' is registered twice: by builtins.int and builtins.str"):
        registry.register("x", str)
    with (
        installed_plugin(tmp_path, "broken", {"fedfleet.test-broken": {"broken": "no_such_module_here"}}),
        pytest.raises(RegistryError, match=r"plugin 'broken' \(no_such_module_here.*failed to load: ModuleNotFound"),
    ):
        registry.load()
