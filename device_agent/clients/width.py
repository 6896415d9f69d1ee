"""Dense models of some width: FedAvg (width 1), FedAvg on the smallest model, HeteroFL, FedRolex.

The server extracts a ceil(C * rate)-channel sub-model (a prefix for HeteroFL, a rolling window
for FedRolex; the client cannot tell which) and the client trains it as a plain dense model.
HeteroFL's Scaler divides convolution outputs by the rate during training only (meta
``"scaler": true``); with label-masked classifier rows (meta ``"send_classes": true``) the client
tells the server which classes it has, so rows of classes it never saw are not averaged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from device_agent.clients.base import ClientProgram, load_tensors, trainable_state
from device_agent.models import build_model


class WidthProgram(ClientProgram):
    def __init__(
        self,
        meta: Mapping[str, Any],
        tensors: Mapping[str, torch.Tensor],
        local: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        super().__init__(meta, tensors, local)
        self.rate = float(meta["level"])
        self.model = build_model(meta["arch"], int(meta["num_classes"]), int(meta["in_channels"]), width=self.rate)
        load_tensors(self.model, tensors)

    def upload(self) -> dict[str, torch.Tensor]:
        return trainable_state(self.model)

    def extras(self) -> dict[str, torch.Tensor]:
        if self.meta.get("send_classes") and self.local_classes is not None:
            return {"classes": self.local_classes.to(torch.int64)}
        return {}

    def train_scale(self) -> float:
        return 1.0 / self.rate if self.meta.get("scaler") else 1.0
