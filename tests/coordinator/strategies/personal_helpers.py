"""A tiny in-test round driver: configure -> device program -> local training -> upload -> close."""

from __future__ import annotations

import torch

from coordinator.strategies import ClientSlot, ModelSpec, Strategy
from device_agent.clients import build_program
from device_agent.training.optimizer import TrainConfig, train_local

CNN = ModelSpec("cnn", num_classes=4, in_channels=1, image_size=8)


def client_data(index: int, samples: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + index)
    return torch.randn(samples, 1, 8, 8, generator=gen), torch.randint(0, 4, (samples,), generator=gen)


def run_round(
    strategy: Strategy, round: int, slots: list[ClientSlot], kept: dict[str, dict[str, torch.Tensor]]
) -> dict[str, dict[str, torch.Tensor]]:
    """One round over in-process clients; returns each client's upload. ``kept`` is the devices' storage."""
    assignments = strategy.configure(round, slots)
    aggregate = strategy.open_round(round, slots)
    uploads = {}
    for index, slot in enumerate(slots):
        assignment = assignments[slot.client_id]
        program = build_program(assignment.spec, assignment.tensors, kept.get(slot.client_id))
        train_local(program, client_data(index), TrainConfig(epochs=1, batch_size=8, lr=0.05, seed=round))
        uploads[slot.client_id] = program.upload()
        aggregate.add(slot.client_id, program.upload(), slot.num_samples, program.extras())
        kept[slot.client_id] = program.keep()
    strategy.close_round(aggregate)
    return uploads


def slots(count: int = 3) -> list[ClientSlot]:
    return [ClientSlot(f"dev-{i}", 1.0, 24) for i in range(count)]


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())
