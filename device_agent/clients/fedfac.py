"""FedFac client (seed 002): an ordinary dense model; the server decides what is shared.

The device is stateless: its personal elements come back inside each assignment, and it returns
the whole model (the server's factor analysis needs every element of the split layers from every
client, and it persists the personal ones).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from device_agent.clients.base import ClientProgram
from device_agent.models import build_model


class FedFacProgram(ClientProgram):
    def __init__(
        self,
        meta: Mapping[str, Any],
        tensors: Mapping[str, torch.Tensor],
        local: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        super().__init__(meta, tensors, local)
        self.model = build_model(str(meta["arch"]), int(meta["num_classes"]), int(meta["in_channels"]))
        self.model.load_state_dict(dict(tensors))

    def upload(self) -> dict[str, torch.Tensor]:
        return {key: value.detach().clone() for key, value in self.model.state_dict().items()}
