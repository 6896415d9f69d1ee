"""FedFac (seed 002): factor analysis splits chosen layers into shared and personal elements.

For each split layer the server runs factor analysis over the round's client weights
(``coordinator.algorithms.factor_analysis``); elements with communality >= tau are shared and
averaged by sample count, the others are personal and the server keeps each client's own. The
split layers' bias and following BatchNorm are personal; every other layer is FedAvg. ``static``
splits once, after the first round of local training, and keeps it; ``dynamic`` (the paper's
recommendation) re-splits every round.

Clients are stateless and upload their whole model: the factor analysis needs every element of
the split layers from every client, and the server persists the personal ones with the run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar, Literal

import torch
from pydantic import BaseModel, Field, field_validator
from torch import nn

from coordinator.algorithms.factor_analysis import split_elements
from coordinator.strategies.base import (
    Assignment,
    ClientSlot,
    ModelSpec,
    RoundAggregate,
    Strategy,
    StrategyParams,
    seeded_model,
    state_bytes,
)
from coordinator.strategies.buffered import (
    BufferedRound,
    client_states,
    sample_weights,
    unprefixed,
    weighted_mean,
)
from coordinator.strategies.upload_contract import UploadContract
from device_agent.clients.base import ClientProgram
from device_agent.clients.fedfac import FedFacProgram
from device_agent.clients.spec import FedFacSpec


class FedFacParams(StrategyParams):
    layers: tuple[str, ...] | None = Field(
        None, description="conv/linear module names to split; default: the last layer before the classifier"
    )
    kappa: float = Field(0.85, gt=0, le=1, description="cumulative eigenvalue share that fixes the number of factors")
    tau_quantile: float | Literal["inf"] = Field(
        0.5, description="communality quantile tau (paper: 0.25, 0.5, 0.75) or 'inf' for every element personal"
    )
    loadings: Literal["principal_factor", "eigenvectors"] = Field(
        "principal_factor", description="paper's iterated principal factors, or the reference's raw eigenvectors"
    )
    mode: Literal["static", "dynamic"] = "dynamic"

    @field_validator("tau_quantile")
    @classmethod
    def _quantile_in_range(cls, value: float | str) -> float | str:
        if isinstance(value, float) and not 0.0 <= value <= 1.0:
            raise ValueError(f"must be in [0, 1] or 'inf', got {value}")
        return value


def _norm_after(model: nn.Module, layer: str) -> str | None:
    """The BatchNorm that normalizes ``layer``'s output: the next one in module order with matching width."""
    names = [(n, m) for n, m in model.named_modules()]
    index = next(i for i, (n, _) in enumerate(names) if n == layer)
    width = names[index][1].weight.shape[0]
    for name, module in names[index + 1 :]:
        if isinstance(module, nn.Conv2d | nn.Linear):
            return None
        if isinstance(module, nn.BatchNorm2d | nn.BatchNorm1d) and module.num_features == width:
            return name
    return None


class FedFac(Strategy):
    name: ClassVar[str] = "fedfac"
    Params: ClassVar[type[FedFacParams]] = FedFacParams
    program: ClassVar[type[ClientProgram]] = FedFacProgram
    personalized: ClassVar[bool] = True

    def __init__(self, model: ModelSpec, params: FedFacParams, seed: int = 0) -> None:
        super().__init__(model, params, seed)
        self.params: FedFacParams = params
        net = seeded_model(model, seed)
        weighted = [n for n, m in net.named_modules() if isinstance(m, nn.Conv2d | nn.Linear)]
        layers = params.layers if params.layers is not None else (weighted[-2],)
        unknown = [n for n in layers if n not in weighted]
        if unknown:
            raise ValueError(f"fedfac layers: {unknown[0]!r} is not a conv/linear layer of {model.arch!r}")
        self.layers = tuple(layers)
        self.global_weights = {k: v.detach().clone() for k, v in net.state_dict().items()}
        self.private_keys: list[str] = []
        for layer in self.layers:
            self.private_keys += [k for k in (f"{layer}.bias",) if k in self.global_weights]
            norm = _norm_after(net, layer)
            if norm is not None:
                self.private_keys += [k for k in self.global_weights if k.startswith(f"{norm}.")]
        self.split: dict[str, torch.Tensor] = {}
        self.personal: dict[str, dict[str, torch.Tensor]] = {}

    @classmethod
    def upload_bytes(cls, model: ModelSpec, params: BaseModel, level: float) -> int:
        """The whole dense model, BN statistics included: the server's factor analysis needs every element."""
        return state_bytes(cls.client_model(model, params, level))

    def _spec(self) -> FedFacSpec:
        return FedFacSpec(strategy="fedfac", model=self.model, level=1.0)

    def _client_state(self, client_id: str) -> dict[str, torch.Tensor]:
        state = {k: v.clone() for k, v in self.global_weights.items()}
        own = self.personal.get(client_id)
        if own is None:
            return state
        for layer, shared in self.split.items():
            key = f"{layer}.weight"
            state[key][~shared] = own[key][~shared]
        state.update({k: own[k].clone() for k in self.private_keys})
        return state

    def configure(self, round: int, clients: Sequence[ClientSlot]) -> dict[str, Assignment]:
        return {slot.client_id: Assignment(self._spec(), self._client_state(slot.client_id)) for slot in clients}

    def upload_contract(self, slot: ClientSlot) -> UploadContract:
        """The whole model, BN statistics and counters included (:meth:`upload_bytes`)."""
        return UploadContract.like(self.global_weights)

    def open_round(self, round: int, clients: Sequence[ClientSlot]) -> RoundAggregate:
        return BufferedRound(round, clients)

    def close_round(self, aggregate: RoundAggregate) -> None:
        if not isinstance(aggregate, BufferedRound):
            raise TypeError(f"{self.name} closes only its own rounds, got {type(aggregate).__name__}")
        uploads = aggregate.ordered()
        if not uploads:
            return
        quantile = None if self.params.tau_quantile == "inf" else float(self.params.tau_quantile)
        if self.params.mode == "dynamic" or not self.split:
            for layer in self.layers:
                weights = [u.tensors[f"{layer}.weight"] for u in uploads]
                if len(weights) < 2:
                    # One client has no cross-client structure to analyse: keep the split it has.
                    self.split.setdefault(layer, torch.zeros(weights[0].shape[0], dtype=torch.bool))
                    continue
                self.split[layer] = split_elements(weights, self.params.kappa, quantile, self.params.loadings).shared
        share = sample_weights(uploads)
        for key, value in self.global_weights.items():
            if value.is_floating_point():
                self.global_weights[key] = weighted_mean(uploads, key, share)
        for upload in uploads:
            own = {f"{layer}.weight": upload.tensors[f"{layer}.weight"].clone() for layer in self.layers}
            own.update({k: upload.tensors[k].clone() for k in self.private_keys})
            self.personal[upload.client_id] = own

    def global_state(self) -> dict[str, torch.Tensor]:
        """Plain FedAvg of the last round (shared and personal elements alike): what a newcomer starts from."""
        return {k: v.clone() for k, v in self.global_weights.items()}

    def personalized_state(self, client_id: str) -> dict[str, torch.Tensor] | None:
        return self._client_state(client_id) if client_id in self.personal else None

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {f"global/{k}": v.clone() for k, v in self.global_weights.items()}
        state.update({f"split/{layer}": mask.to(torch.uint8) for layer, mask in self.split.items()})
        for client, tensors in self.personal.items():
            state.update({f"client/{client}/{k}": v.clone() for k, v in tensors.items()})
        return state

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        weights = unprefixed(state, "global")
        if set(weights) != set(self.global_weights):
            raise ValueError(f"{self.name} state does not match model {self.model.arch!r}")
        self.global_weights = weights
        self.split = {k: v.bool() for k, v in unprefixed(state, "split").items()}
        self.personal = client_states(state)
