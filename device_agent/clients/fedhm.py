"""FedHM on the device: the hybrid model at rank ratio gamma, trained with Frobenius decay on factors.

The assignment holds the factors of the device's rank level (one server decomposition serves
every level), the full-rank layers and the norm parameters; the upload is the same set after
training, never a dense copy of a factorized layer, plus the local classes when the server's
label-masked classifier asks for them (spec ``send_classes``). Factors get Frobenius decay only (the spec's
``frobenius_decay``), dense parameters plain L2: the reference's double decay is not copied.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch
from torch import nn

from device_agent.clients.base import ClientProgram, trainable_state
from device_agent.clients.spec import FedHMSpec
from device_agent.layers.hybrid import hybrid
from device_agent.layers.regularizers import apply_frobenius_decay_, frobenius_penalty, parameter_groups


class FedHMProgram(ClientProgram):
    Spec: ClassVar[type[FedHMSpec]] = FedHMSpec
    spec: FedHMSpec

    def __init__(
        self,
        spec: FedHMSpec,
        tensors: Mapping[str, torch.Tensor],
        local: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        super().__init__(spec, tensors, local)
        self.decay = spec.frobenius_decay

    @classmethod
    def build_model(cls, spec: FedHMSpec) -> nn.Module:  # type: ignore[override]
        return hybrid(spec.model.arch, spec.level, spec.model.num_classes, spec.model.in_channels)

    def after_backward(self) -> None:
        apply_frobenius_decay_(self.model, self.decay)

    def gradient_penalty(self) -> torch.Tensor | None:
        return frobenius_penalty(self.model, self.decay) if self.decay else None

    def param_groups(self, weight_decay: float) -> list[dict]:
        return parameter_groups(self.model, weight_decay)

    def upload(self) -> dict[str, torch.Tensor]:
        return trainable_state(self.model)

    def extras(self) -> dict[str, torch.Tensor]:
        if self.spec.send_classes and self.local_classes is not None:
            return {"classes": self.local_classes.to(torch.int64)}
        return {}
