"""The strategy <-> client contract check, for a strategy's author (a plugin's too) and the test suite.

One registry entry pairs a server strategy with its client program (``Strategy.program``); the program names
the spec it consumes. :func:`check_contract` sends a strategy's assignments as the wire does (the spec inside
an ``Assignment`` message, the tensors as safetensors), builds the program from what the device parsed,
trains it, holds its upload to the strategy's ``upload_contract`` as the upload gate does (the header first), and
folds it back through the strategy's round: what a fleet does, without one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from coordinator.algorithms.aggregation import UpdateRejected
from coordinator.strategies import ClientSlot, ModelSpec, build_strategy
from device_agent.clients import build_program
from device_agent.clients.spec import TrainConfig
from device_agent.training.optimizer import train_local
from device_agent.wire.codec import decode_tensors, encode_tensors, header_specs
from device_agent.wire.messages import Assignment, encode, parse_message
from device_agent.wire.protocol import pack_upload, split_upload

CNN = ModelSpec("cnn", 4, 1, 8)
"""A model small enough to train in a test: 4 classes of 8x8 one-channel images."""


class ContractBroken(AssertionError):
    """A strategy and its client program disagree; the message says where."""


def contract_levels(strategy_name: str, model: ModelSpec = CNN) -> tuple[float, ...]:
    """Two slots' levels for any strategy's :class:`LevelScale`: the whole model, and half of it when the scale
    sizes models (a custom scale included: its own ``problem`` says whether 0.5 is a level)."""
    scale = build_strategy(strategy_name, model, {}, seed=1).levels
    return (1.0, 0.5) if scale.sized and scale.problem(0.5) is None else (1.0, 1.0)


def check_contract(name: str, model: ModelSpec = CNN, levels: Sequence[float] | None = None) -> None:
    """Raise :class:`ContractBroken` unless ``name``'s assignments, parsed as the wire does, build its program,
    train, upload exactly what ``upload_contract`` declares, fold back and leave a finite global state.
    ``levels``: one slot per level (default :func:`contract_levels`)."""
    strategy = build_strategy(name, model, {}, seed=1)
    levels = tuple(levels) if levels is not None else contract_levels(name, model)
    slots = [ClientSlot(f"dev-{i}", level, 12) for i, level in enumerate(levels)]
    assignments = strategy.configure(1, slots)
    aggregate = strategy.open_round(1, slots)
    for index, slot in enumerate(slots):
        sent = assignments[slot.client_id]
        message = Assignment(
            run="r", round=1, deadline_s=5, download="0" * 32, spec=sent.spec, train=TrainConfig(batch_size=4)
        )
        received = parse_message(encode(message))
        if not isinstance(received, Assignment) or received.spec != sent.spec:
            raise ContractBroken(f"{name}: the spec of level {slot.level} does not survive the wire")
        if type(received.spec) is not strategy.program.Spec:
            raise ContractBroken(
                f"{name}: the device parses a {type(received.spec).__name__}, its program takes "
                f"{strategy.program.Spec.__name__}"
            )
        program = build_program(received.spec, decode_tensors(encode_tensors(sent.tensors)))
        if type(program) is not strategy.program:
            built, wanted = type(program).__name__, strategy.program.__name__
            raise ContractBroken(f"{name}: the device built a {built}, not {wanted}")
        gen = torch.Generator().manual_seed(index)
        shape = (12, model.in_channels, model.image_size, model.image_size)
        data = torch.randn(*shape, generator=gen), torch.randint(0, model.num_classes, (12,), generator=gen)
        train_local(program, data, received.train)
        payload = encode_tensors(pack_upload(program.upload(), program.extras()))
        contract = strategy.upload_contract(slot)
        try:
            contract.check_specs(*split_upload(header_specs(payload)))  # as the upload gate reads it
            upload, extras = split_upload(decode_tensors(payload))
            contract.check_values(upload, extras)
        except UpdateRejected as exc:
            broken = f"{name}: the upload at level {slot.level} breaks its upload_contract: {exc}"
            raise ContractBroken(broken) from None
        aggregate.add(slot.client_id, upload, 12, extras)
    strategy.close_round(aggregate)
    broken = [k for k, v in strategy.global_state().items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if broken:
        raise ContractBroken(f"{name}: the global state is not finite after one round ({', '.join(broken[:5])})")
