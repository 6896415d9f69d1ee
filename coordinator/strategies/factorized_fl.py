"""Factorized-FL and Factorized-FL beta (seed 000) on the coordinator.

Each client uploads u of every shared layer and v of the second-to-last layer. The server keeps
one personalized u per client: u_k = sum_i softmax_i(eps * sigma_ki) u_i over the round's
clients, sigma from cosine similarity of their v (Eq. 4-5). All of a round's new u are computed
together from that round's uploads (the reference overwrote u in place inside its client loop, so
later clients mixed already-mixed vectors and the result depended on client order).

The beta variant (Algorithm 2) also uploads and mixes v and mu with the same weights.

A client's first assignment is the whole initial model (with the last round's mean u if there is
one); after that it receives only its personalized factors and keeps the rest on the device.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

import torch
from pydantic import Field
from torch import nn

from coordinator.algorithms.similarity import cosine_matrix, mix, mixing_weights
from coordinator.strategies.base import Assignment, ClientSlot, ModelSpec, RoundAggregate, Strategy, StrategyParams
from coordinator.strategies.buffered import (
    BufferedRound,
    client_states,
    sample_weights,
    unprefixed,
    weighted_mean,
)
from coordinator.strategies.upload_contract import UploadContract
from device_agent.clients.base import ClientProgram
from device_agent.clients.rank_one import FactorizedFLBetaProgram, FactorizedFLProgram, rank_one_model, shared_layers
from device_agent.clients.spec import FactorizedFLBetaSpec, FactorizedFLSpec
from device_agent.layers import dense_state, rank_one_layers, similarity_layer


class FactorizedFLParams(StrategyParams):
    tau: float = Field(0.0, ge=-1.0, le=1.0, description="peers with cosine(v) below tau get weight 0")
    eps: float = Field(1.0, gt=0, description="softmax scale on similarities (seed 000: 1 single-domain, 20 multi)")
    min_peers: int = Field(
        0,
        ge=0,
        description="keep at least this many most-similar peers even below tau: the reference's minimum_aggr"
        " minus one (it counts the client itself)",
    )
    lambda_sparsity: float = Field(1e-3, ge=0, description="L1 strength on mu (seed 000: 5e-4 to 1e-3)")
    prune_below: float = Field(0.0, ge=0, description="zero |mu| below this at evaluation (0 = no pruning)")
    share_head: bool = Field(False, description="also share the classifier's factors (never under permuted labels)")


class FactorizedFL(Strategy):
    name: ClassVar[str] = "factorized_fl"
    Params: ClassVar[type[FactorizedFLParams]] = FactorizedFLParams
    program: ClassVar[type[ClientProgram]] = FactorizedFLProgram
    personalized: ClassVar[bool] = True
    factors: ClassVar[tuple[str, ...]] = ("u",)
    layout: ClassVar[str] = "kernel"

    def __init__(self, model: ModelSpec, params: FactorizedFLParams, seed: int = 0) -> None:
        super().__init__(model, params, seed)
        self.params: FactorizedFLParams = params
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            skeleton = rank_one_model(self._spec())
        self.init_state = {k: v.detach().clone() for k, v in skeleton.state_dict().items()}
        self.layers = shared_layers(skeleton, params.share_head)
        self.similarity_key = f"{similarity_layer(skeleton)}.v"
        self.keys = [f"{name}.{factor}" for name in self.layers for factor in self.factors]
        self.mean: dict[str, torch.Tensor] = {}
        self.personal: dict[str, dict[str, torch.Tensor]] = {}

    @classmethod
    def client_spec(cls, model: ModelSpec, params: FactorizedFLParams) -> FactorizedFLSpec | FactorizedFLBetaSpec:
        """The spec of every assignment: the client program rebuilds its rank-one model from it."""
        return cls.program.Spec(  # type: ignore[return-value, call-arg]
            strategy=cls.name,
            model=model,
            level=1.0,
            layout=cls.layout,
            lambda_sparsity=params.lambda_sparsity,
            prune_below=params.prune_below,
            share_head=params.share_head,
        )

    def _spec(self) -> FactorizedFLSpec | FactorizedFLBetaSpec:
        return self.client_spec(self.model, self.params)

    @classmethod
    def client_model(cls, model: ModelSpec, params: FactorizedFLParams, level: float) -> nn.Module:
        """The rank-one-plus-sparse model (the same at every level), as the client program builds it."""
        with torch.device("meta"):
            return cls.program.build_model(cls.client_spec(model, params))

    @classmethod
    def upload_bytes(cls, model: ModelSpec, params: FactorizedFLParams, level: float) -> int:
        """The factors of every shared layer plus v of the similarity layer.

        Downloads keep the default, the whole model: a newcomer's first assignment (the worst case;
        later ones carry only its u).
        """
        net = cls.client_model(model, params, level)
        layers = rank_one_layers(net)
        shared = shared_layers(net, params.share_head)
        tensors = {(name, factor): getattr(layers[name], factor) for name in shared for factor in cls.factors}
        similarity = similarity_layer(net)
        tensors[(similarity, "v")] = layers[similarity].v
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def configure(self, round: int, clients: Sequence[ClientSlot]) -> dict[str, Assignment]:
        out = {}
        for slot in clients:
            known = self.personal.get(slot.client_id)
            source = known if known is not None else {**self.init_state, **self.mean}
            out[slot.client_id] = Assignment(self._spec(), {k: v.clone() for k, v in source.items()})
        return out

    def upload_contract(self, slot: ClientSlot) -> UploadContract:
        """The shared layers' factors and v of the similarity layer (the same at every level)."""
        return UploadContract.like({k: self.init_state[k] for k in [*self.keys, self.similarity_key]})

    def open_round(self, round: int, clients: Sequence[ClientSlot]) -> RoundAggregate:
        return BufferedRound(round, clients)

    def close_round(self, aggregate: RoundAggregate) -> None:
        if not isinstance(aggregate, BufferedRound):
            raise TypeError(f"{self.name} closes only its own rounds, got {type(aggregate).__name__}")
        uploads = aggregate.ordered()
        if not uploads:
            return
        descriptors = torch.stack([u.tensors[self.similarity_key] for u in uploads])
        weights = mixing_weights(cosine_matrix(descriptors), self.params.tau, self.params.eps, self.params.min_peers)
        share = sample_weights(uploads)
        for key in self.keys:
            mixed = mix(weights, torch.stack([u.tensors[key] for u in uploads]))
            for row, upload in enumerate(uploads):
                self.personal.setdefault(upload.client_id, {})[key] = mixed[row].clone()
            self.mean[key] = weighted_mean(uploads, key, share)

    def global_state(self) -> dict[str, torch.Tensor]:
        """Initial model with the last round's sample-weighted mean factors.

        For plain Factorized-FL that is the mean u with the INITIAL v and mu (the server never
        sees the others): a reference point, not a model anyone trains. Beta's is Factorized-FedAvg.
        """
        skeleton = rank_one_model(self._spec())
        skeleton.load_state_dict({**self.init_state, **self.mean})
        return dense_state(skeleton)

    def personalized_state(self, client_id: str) -> dict[str, torch.Tensor] | None:
        state = self.personal.get(client_id)
        return None if state is None else {k: v.clone() for k, v in state.items()}

    def forget(self, client_id: str) -> None:
        self.personal.pop(client_id, None)

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {f"init/{k}": v for k, v in self.init_state.items()}
        state.update({f"mean/{k}": v for k, v in self.mean.items()})
        for client, tensors in self.personal.items():
            state.update({f"client/{client}/{k}": v for k, v in tensors.items()})
        return {k: v.clone() for k, v in state.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        init = unprefixed(state, "init")
        if set(init) != set(self.init_state):
            raise ValueError(f"{self.name} state does not match model {self.model.arch!r}")
        self.init_state = init
        self.mean = unprefixed(state, "mean")
        self.personal = client_states(state)


class FactorizedFLBeta(FactorizedFL):
    """Also aggregates v and mu (seed 000, Algorithm 2): for label-synchronized settings."""

    name: ClassVar[str] = "factorized_fl_beta"
    program: ClassVar[type[ClientProgram]] = FactorizedFLBetaProgram
    factors: ClassVar[tuple[str, ...]] = ("u", "v", "mu")
