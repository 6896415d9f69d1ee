"""FedFac client (seed 002): an ordinary dense model; the server decides what is shared.

The device is stateless: its personal elements come back inside each assignment, and it returns
the whole model (the server's factor analysis needs every element of the split layers from every
client, and it persists the personal ones).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch
from torch import nn

from device_agent.clients.assignment_check import check_assignment
from device_agent.clients.base import ClientProgram
from device_agent.clients.spec import FedFacSpec
from device_agent.models import build_model


class FedFacProgram(ClientProgram):
    Spec: ClassVar[type[FedFacSpec]] = FedFacSpec
    reuse_model: ClassVar[bool | None] = False  # its load is its own: a fresh model each round
    spec: FedFacSpec

    def load(self, tensors: Mapping[str, torch.Tensor], local: Mapping[str, torch.Tensor] | None) -> None:
        """Every tensor of the dense model, BN statistics included (they are averaged for shared elements)."""
        check_assignment(tensors, self.model.state_dict())
        self.model.load_state_dict(dict(tensors))

    @classmethod
    def build_model(cls, spec: FedFacSpec) -> nn.Module:  # type: ignore[override]
        return build_model(spec.model.arch, spec.model.num_classes, spec.model.in_channels)

    def upload(self) -> dict[str, torch.Tensor]:
        return {key: value.detach().clone() for key, value in self.model.state_dict().items()}
