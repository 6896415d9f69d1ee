"""SimFed (seed 001) on the coordinator: criteria-input similarity and knowledge reflection.

The server holds a fixed Gaussian criteria input x_N and every client's model theta_k. Each round a
client returns its trained model and z_k = E_k(x_N), its encoder's embedding of x_N. The server
computes cosine similarities between the round's z, drops peers below tau and applies Eq. 8,
theta_k <- theta_k + sum_j softmax_j(alpha * sigma_kj) (theta_j - theta_k), to u, v and mu
separately (sigma_kk = 1). Other tensors (BatchNorm, biases, the classifier unless shared) stay
the client's own. No public code exists; this follows the paper, with the conv layout
u in R^{I*F}, v in R^{O*F} of its Eq. 6.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

import torch
from pydantic import Field
from torch import nn

from coordinator.algorithms.similarity import cosine_matrix, mixing_weights, reflect
from coordinator.strategies.base import (
    Assignment,
    ClientSlot,
    ModelSpec,
    RoundAggregate,
    Strategy,
    StrategyParams,
    state_bytes,
)
from coordinator.strategies.buffered import BufferedRound, client_states, unprefixed
from coordinator.strategies.upload_contract import UploadContract
from device_agent.clients.base import ClientProgram
from device_agent.clients.rank_one import SimFedProgram, rank_one_model, shared_layers
from device_agent.clients.spec import SimFedSpec
from device_agent.layers import dense_state, rank_one_layers


class SimFedParams(StrategyParams):
    tau: float = Field(0.0, ge=-1.0, le=1.0, description="peers with cosine(z) below tau are not reflected")
    alpha: float = Field(1.0, gt=0, description="softmax scale on similarities in Eq. 8")
    min_peers: int = Field(0, ge=0, description="keep at least this many most-similar peers even below tau")
    criteria_batch: int = Field(1, ge=1, le=256, description="number of Gaussian criteria inputs")
    lambda_sparsity: float = Field(1e-3, ge=0, description="L1 strength on the sparse masks mu")
    prune_below: float = Field(0.0, ge=0, description="zero |mu| below this at evaluation (0 = no pruning)")
    share_head: bool = Field(False, description="also reflect the classifier's factors")


class SimFed(Strategy):
    name: ClassVar[str] = "simfed"
    Params: ClassVar[type[SimFedParams]] = SimFedParams
    program: ClassVar[type[ClientProgram]] = SimFedProgram
    personalized: ClassVar[bool] = True
    layout: ClassVar[str] = "channel"

    def __init__(self, model: ModelSpec, params: SimFedParams, seed: int = 0) -> None:
        super().__init__(model, params, seed)
        self.params: SimFedParams = params
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            skeleton = rank_one_model(self._spec())
        self.init_state = {k: v.detach().clone() for k, v in skeleton.state_dict().items()}
        self.reflected = [f"{n}.{f}" for n in shared_layers(skeleton, params.share_head) for f in ("u", "v", "mu")]
        generator = torch.Generator().manual_seed(seed)
        shape = (params.criteria_batch, model.in_channels, model.image_size, model.image_size)
        self.criteria = torch.randn(shape, generator=generator)
        head = list(rank_one_layers(skeleton).values())[-1]
        self.embedding_size = params.criteria_batch * head.weight_shape[1]
        self.personal: dict[str, dict[str, torch.Tensor]] = {}
        self.samples: dict[str, int] = {}

    @classmethod
    def client_spec(cls, model: ModelSpec, params: SimFedParams) -> SimFedSpec:
        """The spec of every assignment: the client program rebuilds its rank-one model from it."""
        return SimFedSpec(
            strategy="simfed",
            model=model,
            level=1.0,
            layout="channel",
            lambda_sparsity=params.lambda_sparsity,
            prune_below=params.prune_below,
        )

    def _spec(self) -> SimFedSpec:
        return self.client_spec(self.model, self.params)

    @classmethod
    def client_model(cls, model: ModelSpec, params: SimFedParams, level: float) -> nn.Module:
        """The rank-one-plus-sparse model in SimFed's channel layout, as the client program builds it."""
        with torch.device("meta"):
            return cls.program.build_model(cls.client_spec(model, params))

    @classmethod
    def download_bytes(cls, model: ModelSpec, params: SimFedParams, level: float) -> int:
        """The client's whole model plus the criteria input batch."""
        criteria = params.criteria_batch * model.in_channels * model.image_size**2 * 4
        return super().download_bytes(model, params, level) + criteria

    @classmethod
    def upload_bytes(cls, model: ModelSpec, params: SimFedParams, level: float) -> int:
        """The whole model, BN statistics included: the server keeps every client's theta_k."""
        return state_bytes(cls.client_model(model, params, level))

    def _newcomer_state(self) -> dict[str, torch.Tensor]:
        """What a client the server has no model for starts from: the sample-weighted mean of known ones."""
        if not self.personal:
            return dict(self.init_state)
        clients = sorted(self.personal)
        counts = torch.tensor([self.samples[c] for c in clients], dtype=torch.float64)
        weights = counts / counts.sum()
        out = {}
        for key, value in self.init_state.items():
            if value.is_floating_point():
                stacked = torch.stack([self.personal[c][key].to(torch.float64) for c in clients])
                out[key] = torch.tensordot(weights, stacked, dims=1).to(value.dtype)
            else:
                out[key] = value.clone()
        return out

    def configure(self, round: int, clients: Sequence[ClientSlot]) -> dict[str, Assignment]:
        newcomer = None
        out = {}
        for slot in clients:
            if slot.client_id in self.personal:
                state = self.personal[slot.client_id]
            else:
                newcomer = newcomer if newcomer is not None else self._newcomer_state()
                state = newcomer
            tensors = {k: v.clone() for k, v in state.items()}
            tensors["criteria"] = self.criteria.clone()
            out[slot.client_id] = Assignment(self._spec(), tensors)
        return out

    def upload_contract(self, slot: ClientSlot) -> UploadContract:
        """The client's whole model theta_k, and z_k, its encoder's embedding of the criteria input."""
        return UploadContract.like(self.init_state, {"embedding": torch.empty(self.embedding_size, device="meta")})

    def open_round(self, round: int, clients: Sequence[ClientSlot]) -> RoundAggregate:
        return BufferedRound(round, clients)

    def close_round(self, aggregate: RoundAggregate) -> None:
        if not isinstance(aggregate, BufferedRound):
            raise TypeError(f"{self.name} closes only its own rounds, got {type(aggregate).__name__}")
        uploads = aggregate.ordered()
        if not uploads:
            return
        embeddings = torch.stack([u.extras["embedding"] for u in uploads])
        weights = mixing_weights(cosine_matrix(embeddings), self.params.tau, self.params.alpha, self.params.min_peers)
        new = {u.client_id: dict(u.tensors) for u in uploads}
        for key in self.reflected:
            reflected = reflect(weights, torch.stack([u.tensors[key] for u in uploads]))
            for row, upload in enumerate(uploads):
                new[upload.client_id][key] = reflected[row].clone()
        self.personal.update(new)
        self.samples.update({u.client_id: u.num_samples for u in uploads})

    def global_state(self) -> dict[str, torch.Tensor]:
        """The sample-weighted mean of every known client's model, made dense (a reference point)."""
        skeleton = rank_one_model(self._spec())
        skeleton.load_state_dict(self._newcomer_state())
        return dense_state(skeleton)

    def personalized_state(self, client_id: str) -> dict[str, torch.Tensor] | None:
        state = self.personal.get(client_id)
        return None if state is None else {k: v.clone() for k, v in state.items()}

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {f"init/{k}": v.clone() for k, v in self.init_state.items()}
        state["criteria"] = self.criteria.clone()
        for client, tensors in self.personal.items():
            state.update({f"client/{client}/{k}": v.clone() for k, v in tensors.items()})
            state[f"samples/{client}"] = torch.tensor(self.samples[client], dtype=torch.int64)
        return state

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        init = unprefixed(state, "init")
        if set(init) != set(self.init_state) or "criteria" not in state:
            raise ValueError(f"{self.name} state does not match model {self.model.arch!r}")
        self.init_state, self.criteria = init, state["criteria"].clone()
        self.personal = client_states(state)
        self.samples = {client: int(value) for client, value in unprefixed(state, "samples").items()}
