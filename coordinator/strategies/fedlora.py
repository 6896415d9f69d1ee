"""Federated fine-tuning of a pre-trained ViT (FedHM paper Sec. 5): fedlora, lora_homogeneous and ft.

(hetlora and flora, the other aggregators over the same client, are in ``lora_rules``.)

- ``fedlora``: each device trains LoRA adapters of its own rank r = level x max_rank (levels 1/8
  ... 1 are r = 2 ... 16 with max_rank 16) plus the head. The server rebuilds each client's update
  dW = scale_r B A, averages with FedHM's weighting (Eq. 2, softmax(level / tau) by default) and
  re-factorizes the averaged dW to each rank in the next round by truncated SVD, the best rank-r
  approximation (``coordinator.algorithms.lora``).
- ``lora_homogeneous``: one rank everywhere; A, B and the head are averaged as they are (FedAvg by
  samples). That is what plain federated LoRA does; the product of averages is not the average
  of products, which is the inexactness fedlora's dW aggregation avoids.
- ``ft``: full fine-tuning, FedAvg of the whole pre-trained model: the baseline.

The pre-trained base comes from ``base_checkpoint`` (a safetensors file, timm/HF/fedfleet keys,
read once when the strategy is built); without one the base is a seeded random model (tests).
The LoRA strategies send a device the frozen base in its first assignment only; after it has
uploaded once the device holds it (hash-checked by the spec's ``base_sha256``), and the server
sends it again only after :meth:`forget` (the device lost it).
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import ClassVar, Literal

import torch
from pydantic import Field, PositiveFloat, PositiveInt
from torch import Tensor, nn

from coordinator.algorithms.aggregation import log_score
from coordinator.algorithms.lora import lora_factors
from coordinator.strategies.base import (
    Assignment,
    ClientSlot,
    ModelSpec,
    RosterRound,
    RoundAggregate,
    Strategy,
    StrategyParams,
    seeded_model,
)
from coordinator.strategies.levels import RANK, LevelScale
from coordinator.strategies.upload_contract import UploadContract
from device_agent.clients.base import ClientProgram
from device_agent.clients.lora import TARGETS, LoRAProgram
from device_agent.clients.spec import LoRASpec
from device_agent.common.tensor_spec import TensorSpec
from device_agent.layers.lora import (
    FACTORS,
    Layout,
    Scale,
    apply_lora,
    base_state,
    delta_targets,
    lora_layers,
    lora_scale,
    state_digest,
)
from device_agent.models.vit import load_checkpoint

PLANNING_DIGEST = "0" * 64
"""The digest in specs built only to size a client model (no base involved)."""


class FineTuneParams(StrategyParams):
    base_checkpoint: str | None = None
    """Safetensors file of the pre-trained model; None: a seeded random model (tests only)."""


class LoRAParams(FineTuneParams):
    max_rank: PositiveInt = 16
    """The rank of level 1; fedlora's rank is round(level x max_rank)."""
    alpha: PositiveFloat = 16.0
    """The numerator of ``scale`` (alpha / r by default)."""
    scale: Scale = "alpha_over_r"
    """alpha_over_r: alpha / r (LoRA); one: 1 (the FedHM reference code, alpha = r); rslora: alpha / sqrt(r)."""
    targets: Literal["attn", "attn_mlp"] = "attn"
    adapter_layout: Layout = "separate"
    """separate: a bypass on each of q, k, v, proj; fused_qkv: one on the fused qkv projection and one on
    proj, the paper's and its reference code's layout (27,648 r trainable parameters per ViT-S)."""
    train_head: bool = True
    """false: the pre-trained head is kept frozen (sent with the base), so it must fit the task's classes."""


class FedLoRAParams(LoRAParams):
    weighting: Literal["paper", "reference", "samples", "uniform"] = "paper"
    """As FedHM: paper softmax(level / tau), reference softmax(-(1/level) / tau), samples, uniform."""
    temperature: float = Field(1.0, gt=0)


class HomogeneousLoRAParams(LoRAParams):
    rank: PositiveInt = 4
    """The one rank every device trains."""


def pretrained_state(
    model: ModelSpec, checkpoint: str | None, seed: int, require_head: bool = False
) -> dict[str, Tensor]:
    """The plain model's state dict from ``checkpoint``; a head of another shape (or none) starts at zero.

    ``require_head``: the head will be frozen (``train_head: false``), so a zero head would make
    every prediction the same; the checkpoint must carry one of the right shape.
    """
    reference = seeded_model(model, seed).state_dict()
    if checkpoint is None:
        return reference
    if not Path(checkpoint).is_file():
        raise ValueError(
            f"base_checkpoint {checkpoint}: no such file; write one with `coordinator pretrain --arch {model.arch}"
            f" --out {checkpoint}` or point at a downloaded timm/HF safetensors file"
        )
    loaded = load_checkpoint(checkpoint)
    for key in ("head.weight", "head.bias"):
        if key not in loaded or loaded[key].shape != reference[key].shape:
            if require_head:
                found = tuple(loaded[key].shape) if key in loaded else "none"
                raise ValueError(
                    f"train_head: false keeps the pre-trained head frozen, but {checkpoint} has {key} {found},"
                    f" {model.arch} with {model.num_classes} classes needs {tuple(reference[key].shape)};"
                    " set train_head: true (a new head trained from zero)"
                )
            loaded[key] = torch.zeros_like(reference[key])
    if loaded.keys() != reference.keys():
        missing, extra = sorted(reference.keys() - loaded.keys()), sorted(loaded.keys() - reference.keys())
        raise ValueError(f"{checkpoint} does not fit {model.arch}: missing {missing[:5]}, unexpected {extra[:5]}")
    for key, value in loaded.items():
        if value.shape != reference[key].shape:
            raise ValueError(
                f"{checkpoint}: {key} has shape {tuple(value.shape)}, {model.arch} needs {tuple(reference[key].shape)}"
            )
    return {k: v.to(reference[k].dtype) for k, v in loaded.items()}


class FineTuneRound(RosterRound):
    """Folds uploads as they arrive: a weighted running mean of each client's contribution.

    ``expected`` gives the upload's key -> shape for a level, ``contribution`` turns an upload
    into what is averaged (fedlora: dense updates), ``score`` is a client's log-weight. Scores are
    kept relative to a running maximum (as in FedHM's StreamingAggregator), so no weight underflows.
    """

    def __init__(self, round: int, clients: Sequence[ClientSlot], strategy: FineTune) -> None:
        super().__init__(round, clients)
        self.strategy = strategy
        self.sums: dict[str, Tensor] = {}
        self.total = 0.0
        self.shift = -math.inf

    def fold(
        self,
        client_id: str,
        tensors: dict[str, Tensor],
        num_samples: int,
        extras: dict[str, Tensor] | None = None,
    ) -> None:
        level = self.slots[client_id].level
        score = self.strategy.score(level, num_samples)
        if score > self.shift:
            rescale = math.exp(self.shift - score) if self.shift > -math.inf else 0.0
            for value in self.sums.values():
                value.mul_(rescale)
            self.total *= rescale
            self.shift = score
        weight = math.exp(score - self.shift)
        for key, value in self.strategy.contribution(tensors, level).items():
            term = value.to(torch.float64) * weight
            self.sums[key] = self.sums[key] + term if key in self.sums else term
        self.total += weight
        self.received.append(client_id)

    def means(self) -> dict[str, Tensor]:
        return {key: (value / self.total).float() for key, value in self.sums.items()}


class FineTune(Strategy):
    """ft: full fine-tuning of the pre-trained model, FedAvg by samples."""

    name: ClassVar[str] = "ft"
    Params: ClassVar[type[FineTuneParams]] = FineTuneParams
    program: ClassVar[type[ClientProgram]] = LoRAProgram
    personalized: ClassVar[bool] = False
    params: FineTuneParams

    def __init__(self, model: ModelSpec, params: FineTuneParams, seed: int = 0) -> None:
        super().__init__(model, params, seed)
        frozen_head = isinstance(params, LoRAParams) and not params.train_head
        self.pretrained = pretrained_state(model, params.base_checkpoint, seed, require_head=frozen_head)
        self.state = dict(self.pretrained)

    @classmethod
    def spec(cls, model: ModelSpec, params: FineTuneParams, level: float, digest: str) -> LoRASpec:
        return LoRASpec(
            strategy="ft",
            model=model,
            level=level,
            rank=None,
            alpha=1.0,
            scale="alpha_over_r",
            targets="attn",
            adapter_layout="separate",
            train_head=True,
            base_sha256=None,
        )

    @classmethod
    def client_model(cls, model: ModelSpec, params: FineTuneParams, level: float) -> nn.Module:
        with torch.device("meta"):
            return cls.program.build_model(cls.spec(model, params, level, PLANNING_DIGEST))

    def expected_upload(self, level: float) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in self.state.items()}

    def upload_contract(self, slot: ClientSlot) -> UploadContract:
        """:meth:`expected_upload` at the slot's level, in float32 (frozen base tensors are never part of it)."""
        return UploadContract(
            {k: TensorSpec(shape, torch.float32) for k, shape in self.expected_upload(slot.level).items()}
        )

    def score(self, level: float, num_samples: int) -> float:
        return math.log(num_samples)

    def contribution(self, tensors: Mapping[str, Tensor], level: float) -> Mapping[str, Tensor]:
        return tensors

    def configure(self, round: int, clients: Sequence[ClientSlot]) -> dict[str, Assignment]:
        return {
            slot.client_id: Assignment(self.spec(self.model, self.params, slot.level, ""), dict(self.state))
            for slot in clients
        }

    def open_round(self, round: int, clients: Sequence[ClientSlot]) -> RoundAggregate:
        return FineTuneRound(round, clients, self)

    def close_round(self, aggregate: RoundAggregate) -> None:
        if not isinstance(aggregate, FineTuneRound):
            raise TypeError(f"{self.name} cannot close a {type(aggregate).__name__}")
        if aggregate.received:
            self.absorb(aggregate.means())
            self.keep(aggregate)
            self.after_round(aggregate.received)

    def absorb(self, means: Mapping[str, Tensor]) -> None:
        self.state.update(means)

    def keep(self, aggregate: FineTuneRound) -> None:
        """What the strategy keeps of a round beyond its means (the ranked LoRA rules: each client's factors)."""

    def after_round(self, uploaded: Sequence[str]) -> None:
        """Note who took part (the LoRA strategies: who now holds the base)."""

    def global_state(self) -> dict[str, Tensor]:
        return dict(self.state)

    def state_dict(self) -> dict[str, Tensor]:
        return {f"global/{k}": v for k, v in self.state.items()}

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        loaded = {k.removeprefix("global/"): v.clone() for k, v in state.items() if k.startswith("global/")}
        if loaded.keys() != self.state.keys():
            raise KeyError(f"{self.name} state does not match model {self.model.arch!r}")
        self.state = loaded


class LoRAStrategy(FineTune):
    """What fedlora and lora_homogeneous share: a frozen base sent once, adapters and head exchanged."""

    personalized: ClassVar[bool] = False
    params: LoRAParams

    def __init__(self, model: ModelSpec, params: LoRAParams, seed: int = 0) -> None:
        super().__init__(model, params, seed)
        skeleton = self.client_model(model, params, 1.0)
        self.base_keys = sorted(base_state(skeleton))
        self.layers = {name: (m.out_features, m.in_features) for name, m in lora_layers(skeleton).items()}
        self.targets = delta_targets(skeleton)
        """Adapter -> the base weights (and their rows of B A) its update lands in (fused_qkv: q, k, v)."""
        self.head_keys = sorted(set(self.pretrained) - set(self.base_keys))
        self.base = {k: self.pretrained[k] for k in self.base_keys}
        self.digest = state_digest(self.base)
        self.state = {k: self.pretrained[k] for k in self.head_keys}
        self.holders: set[str] = set()

    @classmethod
    def spec(cls, model: ModelSpec, params: LoRAParams, level: float, digest: str) -> LoRASpec:  # type: ignore[override]
        return LoRASpec(
            strategy=cls.name,  # type: ignore[arg-type]
            model=model,
            level=level,
            rank=cls.rank_of(params, level),
            alpha=params.alpha,
            scale=params.scale,
            targets=params.targets,
            adapter_layout=params.adapter_layout,
            train_head=params.train_head,
            base_sha256=digest,
        )

    @classmethod
    @abstractmethod
    def rank_of(cls, params: LoRAParams, level: float) -> int:
        """The adapter rank a client at ``level`` trains (heterogeneous, or one rank everywhere)."""

    def scale_of(self, rank: int) -> float:
        """The bypass scale at ``rank`` (``params.scale``)."""
        return lora_scale(self.params.scale, self.params.alpha, rank)

    def expected_upload(self, level: float) -> dict[str, tuple[int, ...]]:
        r = self.rank_of(self.params, level)
        shapes = {k: tuple(self.state[k].shape) for k in self.head_keys}
        for name, (out_features, in_features) in self.layers.items():
            shapes[f"{name}.reduce"], shapes[f"{name}.expand"] = (r, in_features), (out_features, r)
        return shapes

    @abstractmethod
    def adapters(self, ranks: set[int]) -> dict[int, dict[str, Tensor]]:
        """Each rank's adapter tensors and the head, for the next round."""

    def fresh_adapters(self, rank: int, salt: int = 0) -> dict[str, Tensor]:
        """LoRA's own init, seeded: A Kaiming-uniform, B = 0 (the pre-trained model, unchanged).

        ``salt`` draws another A for the same rank (flora: a new adapter after each merge).
        """
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed + rank + (salt << 20))
            skeleton = apply_lora(
                seeded_model(self.model, self.seed),
                rank,
                self.scale_of(rank),
                TARGETS[self.params.targets],
                layout=self.params.adapter_layout,
            )
        return {
            f"{name}.{factor}": getattr(layer, factor).detach().clone()
            for name, layer in lora_layers(skeleton).items()
            for factor in FACTORS
        }

    def configure(self, round: int, clients: Sequence[ClientSlot]) -> dict[str, Assignment]:
        adapters = self.adapters({self.rank_of(self.params, slot.level) for slot in clients})
        out = {}
        for slot in clients:
            tensors = dict(adapters[self.rank_of(self.params, slot.level)])
            if slot.client_id not in self.holders:
                tensors.update(self.base)
            out[slot.client_id] = Assignment(self.spec(self.model, self.params, slot.level, self.digest), tensors)
        return out

    def after_round(self, uploaded: Sequence[str]) -> None:
        self.holders.update(uploaded)

    def forget(self, client_id: str) -> None:
        self.holders.discard(client_id)

    def state_dict(self) -> dict[str, Tensor]:
        state = {f"base/{k}": v for k, v in self.base.items()}
        state.update({f"global/{k}": v for k, v in self.state.items()})
        state.update({f"holder/{client}": torch.ones(()) for client in sorted(self.holders)})
        return state

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        base = {k.removeprefix("base/"): v.clone() for k, v in state.items() if k.startswith("base/")}
        if base.keys() != self.base.keys():
            raise KeyError(f"{self.name} state holds no base for model {self.model.arch!r}")
        self.base, self.digest = base, state_digest(base)
        self.state = {k.removeprefix("global/"): v.clone() for k, v in state.items() if k.startswith("global/")}
        self.holders = {k.removeprefix("holder/") for k in state if k.startswith("holder/")}

    def merged(self, deltas: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The plain model: base weights plus each adapter's update (split over q, k, v when fused), and the head."""
        out = {**self.base, **{k: self.state[k] for k in self.head_keys}}
        for name, delta in deltas.items():
            for key, rows in self.targets[name]:
                out[key] = self.base[key] + delta[rows]
        return out


class FedLoRA(LoRAStrategy):
    """fedlora: heterogeneous ranks, averaged updates dW re-factorized to each rank."""

    name: ClassVar[str] = "fedlora"
    Params: ClassVar[type[FedLoRAParams]] = FedLoRAParams
    levels: ClassVar[LevelScale] = RANK
    params: FedLoRAParams

    def __init__(self, model: ModelSpec, params: FedLoRAParams, seed: int = 0) -> None:
        super().__init__(model, params, seed)
        for key in (f"{name}.delta" for name in self.layers):
            self.state[key] = torch.zeros(self.layers[key.removesuffix(".delta")])

    @classmethod
    def rank_of(cls, params: LoRAParams, level: float) -> int:
        return max(1, round(level * params.max_rank))

    @classmethod
    def level_label(cls, params: LoRAParams, level: float) -> str:  # type: ignore[override]
        return f"LoRA r {cls.rank_of(params, level)}"

    def score(self, level: float, num_samples: int) -> float:
        return log_score(self.params.weighting, level, num_samples, self.params.temperature)

    def contribution(self, tensors: Mapping[str, Tensor], level: float) -> Mapping[str, Tensor]:
        scale = self.scale_of(self.rank_of(self.params, level))
        out = {k: tensors[k] for k in self.head_keys}
        for name in self.layers:
            out[f"{name}.delta"] = scale * (tensors[f"{name}.expand"].double() @ tensors[f"{name}.reduce"].double())
        return out

    def adapters(self, ranks: set[int]) -> dict[int, dict[str, Tensor]]:
        scales = {r: self.scale_of(r) for r in ranks}
        out: dict[int, dict[str, Tensor]] = {r: {} for r in ranks}
        fresh = not any(bool(self.state[f"{name}.delta"].any()) for name in self.layers)
        if fresh:
            return {r: {**self.fresh_adapters(r), **{k: self.state[k] for k in self.head_keys}} for r in ranks}
        for name in self.layers:
            for r, (reduce, expand) in lora_factors(self.state[f"{name}.delta"], scales).items():
                out[r][f"{name}.reduce"], out[r][f"{name}.expand"] = reduce, expand
        for r in ranks:
            out[r].update({k: self.state[k] for k in self.head_keys})
        return out

    def global_state(self) -> dict[str, Tensor]:
        return self.merged({name: self.state[f"{name}.delta"] for name in self.layers})


class HomogeneousLoRA(LoRAStrategy):
    """lora_homogeneous: one rank on every device, A, B and the head averaged by samples.

    This is FedIT's rule (Zhang et al., "Towards Building the Federated GPT: Federated Instruction
    Tuning", ICASSP 2024): FedAvg on the LoRA factors (``coordinator.algorithms.lora.average_factors``).
    """

    name: ClassVar[str] = "lora_homogeneous"
    Params: ClassVar[type[HomogeneousLoRAParams]] = HomogeneousLoRAParams
    params: HomogeneousLoRAParams

    def __init__(self, model: ModelSpec, params: HomogeneousLoRAParams, seed: int = 0) -> None:
        super().__init__(model, params, seed)
        self.state.update(self.fresh_adapters(params.rank))

    @classmethod
    def rank_of(cls, params: LoRAParams, level: float) -> int:
        return params.rank  # type: ignore[attr-defined]

    @classmethod
    def level_label(cls, params: LoRAParams, level: float) -> str:  # type: ignore[override]
        return f"LoRA r {cls.rank_of(params, level)} (every device)"

    def expected_upload(self, level: float) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in self.state.items()}

    def adapters(self, ranks: set[int]) -> dict[int, dict[str, Tensor]]:
        return {r: dict(self.state) for r in ranks}

    def global_state(self) -> dict[str, Tensor]:
        scale = self.scale_of(self.params.rank)
        return self.merged(
            {name: scale * (self.state[f"{name}.expand"] @ self.state[f"{name}.reduce"]) for name in self.layers}
        )
