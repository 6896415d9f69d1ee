"""Client programs for models trained as rank-one-plus-sparse layers (Factorized-FL and SimFed).

The model is rebuilt every round from three sources, later ones winning: a fresh skeleton, what
the device kept from its previous round (``local``), and what the coordinator sent. A client's
first assignment carries the whole initial model; later ones only what the server aggregates, so
a device that lost its kept state is told so instead of silently training from random weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch
from torch import nn

from device_agent.clients.assignment_check import Input, check_assignment
from device_agent.clients.base import ClientProgram, KeptStateMissing
from device_agent.clients.spec import FactorizedFLBetaSpec, FactorizedFLSpec, RankOneSpec, SimFedSpec
from device_agent.layers import RankOneLayer, l1_on_mu, rank_one_layers, reparametrize, similarity_layer
from device_agent.models import build_model


def rank_one_model(spec: RankOneSpec) -> nn.Module:
    """The skeleton every party agrees on: the zoo model with every conv / linear made rank-one."""
    model = build_model(spec.model.arch, spec.model.num_classes, spec.model.in_channels)
    return reparametrize(model, layout=spec.layout, prune_below=spec.prune_below)


def shared_layers(model: nn.Module, share_head: bool) -> list[str]:
    """Rank-one layers whose factors leave the device: all of them, the classifier only if shared."""
    names = list(rank_one_layers(model))
    return names if share_head else names[:-1]


class RankOneProgram(ClientProgram):
    """Builds the rank-one model and adds lambda * ||mu||_1 (on the live mu) to the loss."""

    spec: RankOneSpec
    reuse_model: ClassVar[bool | None] = False  # its load is its own: a fresh model each round

    def __init__(
        self,
        spec: RankOneSpec,
        tensors: Mapping[str, torch.Tensor],
        local: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        super().__init__(spec, tensors, local)
        self.lambda_sparsity = spec.lambda_sparsity

    def load(self, tensors: Mapping[str, torch.Tensor], local: Mapping[str, torch.Tensor] | None) -> None:
        """The shared part from the assignment over the private part the device kept."""
        spec = self.spec
        own = self.model.state_dict()
        check_assignment(tensors, own, optional=own.keys(), inputs=self.inputs(spec))
        state = {**(local or {}), **{k: v for k, v in tensors.items() if k in own}}
        missing = sorted(set(own) - set(state))
        if missing:
            source = "kept state and assignment" if local else "assignment (and the device kept no state)"
            raise (ValueError if local else KeptStateMissing)(
                f"{spec.strategy}: {len(missing)} model tensors missing from the {source}, e.g. {missing[0]!r}; "
                "the coordinator sends the whole model only on a client's first round"
            )
        self.model.load_state_dict(state)

    @classmethod
    def build_model(cls, spec: RankOneSpec) -> nn.Module:  # type: ignore[override]
        return rank_one_model(spec)

    @classmethod
    def inputs(cls, spec: RankOneSpec) -> dict[str, Input]:
        """Tensors every assignment carries besides the model's; none by default."""
        return {}

    def regularizer(self) -> torch.Tensor | None:
        if self.lambda_sparsity == 0:
            return None
        return self.lambda_sparsity * l1_on_mu(self.model)

    def layer(self, name: str) -> RankOneLayer:
        return rank_one_layers(self.model)[name]


class FactorizedFLProgram(RankOneProgram):
    """Factorized-FL (seed 000): uploads u of every shared layer and v of the second-to-last layer.

    Everything else (v, mu, biases, BatchNorm, the classifier unless shared) stays on the device
    through :meth:`keep`.
    """

    Spec: ClassVar[type[FactorizedFLSpec]] = FactorizedFLSpec
    spec: FactorizedFLSpec
    factors: tuple[str, ...] = ("u",)

    def upload(self) -> dict[str, torch.Tensor]:
        share_head = self.spec.share_head
        out = {
            f"{name}.{factor}": getattr(self.layer(name), factor).detach().clone()
            for name in shared_layers(self.model, share_head)
            for factor in self.factors
        }
        sim = similarity_layer(self.model)
        out[f"{sim}.v"] = self.layer(sim).v.detach().clone()
        return out

    def keep(self) -> dict[str, torch.Tensor]:
        return {key: value.detach().clone() for key, value in self.model.state_dict().items()}


class FactorizedFLBetaProgram(FactorizedFLProgram):
    """Factorized-FL beta (seed 000, Algorithm 2): v and mu travel and are aggregated too."""

    Spec: ClassVar[type[FactorizedFLBetaSpec]] = FactorizedFLBetaSpec  # type: ignore[assignment]

    factors = ("u", "v", "mu")


class SimFedProgram(RankOneProgram):
    """SimFed (seed 001): the whole model goes back (the server keeps every client's theta_k).

    The extra ``embedding`` is the encoder's output (the classifier's input) on the server's
    fixed Gaussian criteria input, computed in evaluation mode so it does not depend on a batch.
    """

    Spec: ClassVar[type[SimFedSpec]] = SimFedSpec
    spec: SimFedSpec

    def __init__(
        self,
        spec: SimFedSpec,
        tensors: Mapping[str, torch.Tensor],
        local: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        super().__init__(spec, tensors, local)
        self.criteria = tensors["criteria"]

    @classmethod
    def inputs(cls, spec: RankOneSpec) -> dict[str, Input]:
        """The server's criteria batch, shaped like the model's input."""
        model = spec.model
        return {"criteria": Input((None, model.in_channels, model.image_size, model.image_size))}

    def upload(self) -> dict[str, torch.Tensor]:
        return {key: value.detach().clone() for key, value in self.model.state_dict().items()}

    @torch.no_grad()
    def extras(self) -> dict[str, torch.Tensor]:
        head = list(rank_one_layers(self.model).values())[-1]
        captured: list[torch.Tensor] = []
        handle = head.register_forward_hook(lambda _m, inputs, _out: captured.append(inputs[0].detach()))
        was_training = self.model.training
        self.model.eval()
        try:
            device = next(self.model.parameters()).device
            self.model(self.criteria.to(device))
        finally:
            handle.remove()
            self.model.train(was_training)
        return {"embedding": captured[0].flatten().cpu()}
