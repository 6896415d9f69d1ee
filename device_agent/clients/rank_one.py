"""Client programs for models trained as rank-one-plus-sparse layers (Factorized-FL and SimFed).

The model is rebuilt every round from three sources, later ones winning: a fresh skeleton, what
the device kept from its previous round (``local``), and what the coordinator sent. A client's
first assignment carries the whole initial model; later ones only what the server aggregates, so
a device that lost its kept state is told so instead of silently training from random weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from device_agent.clients.base import ClientProgram, KeptStateMissing, require_meta
from device_agent.layers import RankOneLayer, l1_on_mu, rank_one_layers, reparametrize, similarity_layer
from device_agent.models import build_model


def rank_one_model(meta: Mapping[str, Any]) -> nn.Module:
    """The skeleton every party agrees on: the zoo model with every conv / linear made rank-one."""
    model = build_model(str(meta["arch"]), int(meta["num_classes"]), int(meta["in_channels"]))
    return reparametrize(model, layout=meta.get("layout", "kernel"), prune_below=float(meta.get("prune_below", 0.0)))


def shared_layers(model: nn.Module, share_head: bool) -> list[str]:
    """Rank-one layers whose factors leave the device: all of them, the classifier only if shared."""
    names = list(rank_one_layers(model))
    return names if share_head else names[:-1]


class RankOneProgram(ClientProgram):
    """Builds the rank-one model and adds lambda * ||mu||_1 (on the live mu) to the loss."""

    def __init__(
        self,
        meta: Mapping[str, Any],
        tensors: Mapping[str, torch.Tensor],
        local: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        super().__init__(meta, tensors, local)
        require_meta(meta, "lambda_sparsity")
        self.lambda_sparsity = float(meta["lambda_sparsity"])
        self.model = rank_one_model(meta)
        state = dict(local or {})
        state.update({k: v for k, v in tensors.items() if k in self.model.state_dict()})
        missing = sorted(set(self.model.state_dict()) - set(state))
        if missing:
            source = "kept state and assignment" if local else "assignment (and the device kept no state)"
            raise (ValueError if local else KeptStateMissing)(
                f"{meta['strategy']}: {len(missing)} model tensors missing from the {source}, e.g. {missing[0]!r}; "
                "the coordinator sends the whole model only on a client's first round"
            )
        self.model.load_state_dict(state)

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

    factors: tuple[str, ...] = ("u",)

    def upload(self) -> dict[str, torch.Tensor]:
        share_head = bool(self.meta.get("share_head", False))
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

    factors = ("u", "v", "mu")


class SimFedProgram(RankOneProgram):
    """SimFed (seed 001): the whole model goes back (the server keeps every client's theta_k).

    The extra ``embedding`` is the encoder's output (the classifier's input) on the server's
    fixed Gaussian criteria input, computed in evaluation mode so it does not depend on a batch.
    """

    def __init__(
        self,
        meta: Mapping[str, Any],
        tensors: Mapping[str, torch.Tensor],
        local: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        super().__init__(meta, tensors, local)
        if "criteria" not in tensors:
            raise ValueError("simfed: the assignment lacks the 'criteria' input tensor")
        self.criteria = tensors["criteria"]

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
