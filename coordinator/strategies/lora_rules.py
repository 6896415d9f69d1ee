"""The LoRA aggregators a user compares with fedlora, over the same LoRA client: hetlora and flora.

- ``hetlora`` (Cho et al., "Heterogeneous LoRA for Federated Fine-tuning of On-Device Foundation
  Models", EMNLP 2024): clients at ranks r_i; the server zero-pads every client's factors to
  ``max_rank`` and averages A and B with sparsity weights ||B_i A_i||_F / sum (or by samples), and a
  client receives the first r_i rows of A and columns of B. The clients' rank self-pruning is left out.
- ``flora`` (Wang et al., "FLoRA: Federated Fine-Tuning Large Language Models with Heterogeneous
  Low-Rank Adaptations", NeurIPS 2024; code github.com/ATP-1010/FederatedLLM): the clients' factors
  are stacked (A_i scaled by w_i), so the stacked product is exactly sum_i w_i B_i A_i; it is merged
  into the base weights and every client starts the next round from fresh adapters on the new base.

Both run the same client program as fedlora (``LoRAProgram``). The factors are aggregated in
effective form, B times the client's scale (alpha / r_i by default; ``coordinator.algorithms.lora``), and the
head is averaged by samples (neither paper has one: their models are language models).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping, Sequence
from typing import ClassVar, Literal

import torch
from torch import Tensor

from coordinator.algorithms.lora import ClientFactors, sparsity_weights, stack, zero_pad_average
from coordinator.strategies.base import ClientSlot, ModelSpec, RoundAggregate
from coordinator.strategies.fedlora import FineTuneRound, LoRAParams, LoRAStrategy
from coordinator.strategies.levels import RANK, LevelScale
from device_agent.layers.lora import state_digest


class HetLoRAParams(LoRAParams):
    weighting: Literal["sparsity", "samples"] = "sparsity"
    """sparsity: HetLoRA's ||B_i A_i||_F weights, per layer; samples: FedAvg's."""


class FactorRound(FineTuneRound):
    """Keeps each client's factors per layer (effective form) for the close; the head folds by samples."""

    def __init__(self, round: int, clients: Sequence[ClientSlot], strategy: RankedLoRA) -> None:
        super().__init__(round, clients, strategy)
        self.ranked = strategy
        self.factors: dict[str, list[ClientFactors]] = {name: [] for name in strategy.layers}

    def fold(
        self,
        client_id: str,
        tensors: dict[str, Tensor],
        num_samples: int,
        extras: dict[str, Tensor] | None = None,
    ) -> None:
        scale = self.ranked.scale(self.slots[client_id].level)
        for name, uploads in self.factors.items():
            expand, reduce = tensors[f"{name}.expand"].double(), tensors[f"{name}.reduce"].double()
            uploads.append(ClientFactors(scale * expand, reduce, float(num_samples)))
        super().fold(client_id, tensors, num_samples, extras)


class RankedLoRA(LoRAStrategy):
    """What hetlora and flora share: rank r = level x max_rank, as fedlora, and the uploads kept per layer."""

    levels: ClassVar[LevelScale] = RANK

    @classmethod
    def rank_of(cls, params: LoRAParams, level: float) -> int:
        return max(1, round(level * params.max_rank))

    @classmethod
    def level_label(cls, params: LoRAParams, level: float) -> str:  # type: ignore[override]
        return f"LoRA r {cls.rank_of(params, level)}"

    def scale(self, level: float) -> float:
        return self.scale_of(self.rank_of(self.params, level))

    def contribution(self, tensors: Mapping[str, Tensor], level: float) -> Mapping[str, Tensor]:
        return {k: tensors[k] for k in self.head_keys}

    def open_round(self, round: int, clients: Sequence[ClientSlot]) -> RoundAggregate:
        return FactorRound(round, clients, self)

    def keep(self, aggregate: FineTuneRound) -> None:
        if not isinstance(aggregate, FactorRound):
            raise TypeError(f"{self.name} cannot close a {type(aggregate).__name__}")
        self.combine(aggregate.factors)

    @abstractmethod
    def combine(self, factors: Mapping[str, Sequence[ClientFactors]]) -> None:
        """Fold one round's factors, per layer, into the strategy's state."""


class HetLoRA(RankedLoRA):
    """hetlora: zero-padded factors averaged with sparsity weights, truncated to each client's rank (Cho et al.)."""

    name: ClassVar[str] = "hetlora"
    Params: ClassVar[type[HetLoRAParams]] = HetLoRAParams
    params: HetLoRAParams

    def __init__(self, model: ModelSpec, params: HetLoRAParams, seed: int = 0) -> None:
        super().__init__(model, params, seed)
        fresh = self.fresh_adapters(params.max_rank)
        for name in self.layers:  # the global adapter, effective form: B carries the scale at max_rank
            self.state[f"{name}.reduce"] = fresh[f"{name}.reduce"]
            self.state[f"{name}.expand"] = fresh[f"{name}.expand"] * self.scale_of(params.max_rank)

    def combine(self, factors: Mapping[str, Sequence[ClientFactors]]) -> None:
        for name, clients in factors.items():
            weights = [c.weight for c in clients]
            if self.params.weighting == "sparsity" and any(bool((c.expand @ c.reduce).any()) for c in clients):
                weights = sparsity_weights(clients)  # (all updates zero: nothing to weigh, samples it is)
            reduce, expand = zero_pad_average(clients, self.params.max_rank, weights)
            self.state[f"{name}.reduce"], self.state[f"{name}.expand"] = reduce.float(), expand.float()

    def adapters(self, ranks: set[int]) -> dict[int, dict[str, Tensor]]:
        out: dict[int, dict[str, Tensor]] = {}
        for r in ranks:
            out[r] = {k: self.state[k] for k in self.head_keys}
            for name in self.layers:
                out[r][f"{name}.reduce"] = self.state[f"{name}.reduce"][:r].contiguous()
                out[r][f"{name}.expand"] = (self.state[f"{name}.expand"][:, :r] / self.scale_of(r)).contiguous()
        return out

    def global_state(self) -> dict[str, Tensor]:
        return self.merged({name: self.state[f"{name}.expand"] @ self.state[f"{name}.reduce"] for name in self.layers})


class FLoRA(RankedLoRA):
    """flora: stacked factors, the exact weighted sum of B_i A_i, merged into the base each round (Wang et al.)."""

    name: ClassVar[str] = "flora"
    Params: ClassVar[type[LoRAParams]] = LoRAParams

    def __init__(self, model: ModelSpec, params: LoRAParams, seed: int = 0) -> None:
        super().__init__(model, params, seed)
        self.merges = 0

    def combine(self, factors: Mapping[str, Sequence[ClientFactors]]) -> None:
        for name, clients in factors.items():
            reduce, expand = stack(clients)
            for key, rows in self.targets[name]:  # fused_qkv: the qkv update's row blocks go to q, k, v
                self.base[key] = (self.base[key].double() + expand[rows] @ reduce).to(self.base[key].dtype)
        self.digest = state_digest(self.base)
        self.merges += 1

    def after_round(self, uploaded: Sequence[str]) -> None:
        self.holders.clear()  # the base changed: every client needs the merged one

    def adapters(self, ranks: set[int]) -> dict[int, dict[str, Tensor]]:
        """Fresh adapters (B = 0) every round, drawn anew after each merge, as FLoRA re-initializes LoRA."""
        head = {k: self.state[k] for k in self.head_keys}
        return {r: {**self.fresh_adapters(r, salt=self.merges), **head} for r in ranks}

    def global_state(self) -> dict[str, Tensor]:
        return self.merged({})

    def state_dict(self) -> dict[str, Tensor]:
        return {**super().state_dict(), "merges": torch.tensor(self.merges)}

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        super().load_state_dict({k: v for k, v in state.items() if k != "merges"})
        self.merges = int(state["merges"]) if "merges" in state else 0
