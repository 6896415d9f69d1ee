"""Dense models of some width: FedAvg (width 1), FedAvg on the smallest model, HeteroFL, FedRolex.

The server extracts a ceil(C * rate)-channel sub-model (a prefix for HeteroFL, a rolling window
for FedRolex; the client cannot tell which) and the client trains it as a plain dense model.
HeteroFL's Scaler divides convolution outputs by the rate during training only (spec
``scaler``); with label-masked classifier rows (spec ``send_classes``) the client
tells the server which classes it has, so rows of classes it never saw are not averaged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch
from torch import nn

from device_agent.clients.base import ClientProgram, trainable_state
from device_agent.clients.spec import WidthSpec
from device_agent.models import build_model


class WidthProgram(ClientProgram):
    Spec: ClassVar[type[WidthSpec]] = WidthSpec
    spec: WidthSpec

    def __init__(
        self,
        spec: WidthSpec,
        tensors: Mapping[str, torch.Tensor],
        local: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        super().__init__(spec, tensors, local)
        self.rate = spec.level

    @classmethod
    def build_model(cls, spec: WidthSpec) -> nn.Module:  # type: ignore[override]
        return build_model(spec.model.arch, spec.model.num_classes, spec.model.in_channels, width=spec.level)

    def upload(self) -> dict[str, torch.Tensor]:
        return trainable_state(self.model)

    def extras(self) -> dict[str, torch.Tensor]:
        if self.spec.send_classes and self.local_classes is not None:
            return {"classes": self.local_classes.to(torch.int64)}
        return {}

    def train_scale(self) -> float:
        return 1.0 / self.rate if self.spec.scaler else 1.0
