"""The strategy <-> client contract, for every registered strategy.

One registry entry pairs a server strategy with its client program (``Strategy.program``); the
program names the spec it consumes. Here each strategy's assignment travels as the wire does (the
spec inside an ``Assignment`` message, the tensors as safetensors), the device builds the program
from what it parsed, trains, and the server folds the upload back.
"""

from __future__ import annotations

import pytest
import torch

from coordinator.strategies import STRATEGIES, ClientSlot, ModelSpec, build_strategy
from device_agent.clients import PROGRAMS, build_program
from device_agent.clients.spec import TrainConfig, spec_types, strategies_of
from device_agent.training.optimizer import train_local
from device_agent.wire.codec import decode_tensors, encode_tensors
from device_agent.wire.messages import Assignment, encode, parse_message
from device_agent.wire.protocol import pack_upload, split_upload

CNN = ModelSpec("cnn", 4, 1, 8)
VIT = ModelSpec("vit_tiny", 4, 1, 8)
FINE_TUNING = {"fedlora", "lora_homogeneous", "hetlora", "flora", "ft"}
"""Strategies that fine-tune a pre-trained transformer: they run on the ViT."""
LEVELS = {"rank": (1.0, 0.25), "width": (1.0, 0.5), "none": (1.0, 1.0)}


def test_every_strategy_has_the_program_registered_for_its_name_and_every_program_a_strategy() -> None:
    for name, strategy in STRATEGIES.items():
        assert PROGRAMS[name] is strategy.program, name
        assert name in strategies_of(strategy.program.Spec), f"{name}: its program's spec does not accept the name"
    assert set(PROGRAMS) == set(STRATEGIES)
    assert len(spec_types()) == len({program.Spec for program in PROGRAMS.values()})


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_assignment_over_the_wire_trains_and_folds_back(name: str) -> None:
    check_contract(name, VIT if name in FINE_TUNING else CNN)


def check_contract(name: str, model: ModelSpec = CNN) -> None:
    """A strategy's assignments parsed as the wire does, trained by its program, folded back, finite."""
    strategy = build_strategy(name, model, {}, seed=1)
    slots = [ClientSlot(f"dev-{i}", level, 12) for i, level in enumerate(LEVELS[strategy.levels.name])]
    assignments = strategy.configure(1, slots)
    aggregate = strategy.open_round(1, slots)
    for index, slot in enumerate(slots):
        sent = assignments[slot.client_id]
        message = Assignment(
            run="r", round=1, deadline_s=5, download="0" * 32, spec=sent.spec, train=TrainConfig(batch_size=4)
        )
        received = parse_message(encode(message))
        assert isinstance(received, Assignment) and received.spec == sent.spec
        assert type(received.spec) is strategy.program.Spec
        program = build_program(received.spec, decode_tensors(encode_tensors(sent.tensors)))
        assert type(program) is strategy.program
        gen = torch.Generator().manual_seed(index)
        data = torch.randn(12, 1, 8, 8, generator=gen), torch.randint(0, 4, (12,), generator=gen)
        train_local(program, data, received.train)
        upload, extras = split_upload(decode_tensors(encode_tensors(pack_upload(program.upload(), program.extras()))))
        aggregate.add(slot.client_id, upload, 12, extras)
    strategy.close_round(aggregate)
    assert all(torch.isfinite(v).all() for v in strategy.global_state().values() if v.is_floating_point())
