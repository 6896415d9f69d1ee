"""Dense-model baselines: FedAvg, FedAvg on the smallest model, HeteroFL and FedRolex.

A client at width rate r trains the sub-model with ceil(C * r) channels in every hidden layer
(``build_model(..., width=r)``). HeteroFL keeps the first channels (a prefix); FedRolex keeps a
window that rolls by one channel each round, roll(arange(C), round % C)[:k], so every channel
of the global model gets trained by small clients over time. Since the window depends only on
(C, k, round), every tensor dimension of size C uses the same channels, which keeps residual
additions consistent.

Aggregation is element-wise over the clients that hold each element: sums and counts live in
full-shaped accumulators, an element nobody trained keeps its value. HeteroFL's label-masked
classifier: a client's classifier rows count only for classes present in its data.
BatchNorm: static BN, as in HeteroFL - running statistics are never averaged; the caller
recomputes them for evaluation (see :meth:`Strategy.load_norm_statistics`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar, Literal

import torch
from pydantic import BaseModel, Field
from torch import Tensor, nn

from coordinator.algorithms.aggregation import parse_classes
from coordinator.algorithms.robust import buffered_aggregate
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
from coordinator.strategies.levels import NONE, WIDTH, LevelScale
from coordinator.strategies.upload_contract import UploadContract
from device_agent.clients.base import ClientProgram, is_norm_statistic
from device_agent.clients.width import WidthProgram
from device_agent.common.tensor_spec import TensorSpec
from device_agent.models import build_model

Index = tuple[Tensor | None, ...]
"""Kept positions along each dimension of one tensor; None keeps the whole dimension."""


def prefix_window(channels: int, keep: int, round: int) -> Tensor:
    """HeteroFL: the first ``keep`` channels, every round."""
    return torch.arange(keep)


def rolling_window(channels: int, keep: int, round: int) -> Tensor:
    """FedRolex: roll(arange(C), round % C)[:keep] - the window moves by one channel per round."""
    return torch.roll(torch.arange(channels), round % channels)[:keep]


def submodel_index(
    full: Mapping[str, Tensor], sub_shapes: Mapping[str, torch.Size], round: int, window=prefix_window
) -> dict[str, Index]:
    """Per key, the kept positions of each dimension of the full tensor."""
    index: dict[str, Index] = {}
    for key, tensor in full.items():
        shape = sub_shapes[key]
        if len(shape) != tensor.dim():
            raise ValueError(f"{key!r}: sub-model tensor has {len(shape)} dims, full has {tensor.dim()}")
        index[key] = tuple(
            None if keep == size else window(size, keep, round) for size, keep in zip(tensor.shape, shape, strict=True)
        )
    return index


def extract(tensor: Tensor, index: Index) -> Tensor:
    """The sub-tensor at ``index`` (a copy)."""
    out = tensor
    for dim, kept in enumerate(index):
        if kept is not None:
            out = out.index_select(dim, kept)
    return out.clone() if out is tensor else out


def _grid(index: Index, shape: torch.Size) -> tuple[Tensor, ...]:
    full = [torch.arange(size) if kept is None else kept for kept, size in zip(index, shape, strict=True)]
    return torch.meshgrid(*full, indexing="ij") if full else ()


class WidthParams(StrategyParams):
    weighting: Literal["uniform", "samples"] = "uniform"
    """uniform: each holder of an element counts the same (the HeteroFL/FedRolex code); samples: by sample count."""
    label_masked_classifier: bool = True
    scaler: bool = True
    """HeteroFL's Scaler: convolution outputs divided by the rate while training."""


class FedAvgParams(StrategyParams):
    rule: Literal["mean", "median", "trimmed_mean", "multi_krum"] = "mean"
    """mean streams (memory O(model)); the robust rules buffer the round's uploads (O(clients x model)),
    see docs/robust-aggregation.md."""
    trim: float = Field(0.1, ge=0, lt=0.5)
    """trimmed_mean: the fraction of values dropped at each end, per coordinate."""
    byzantine: int = Field(1, ge=0)
    """multi_krum: the malicious devices f it assumes; it keeps the n - f best-scored uploads."""


class FedAvgSmallParams(StrategyParams):
    level: float | None = Field(None, gt=0, le=1)
    """Width of the one model every client trains; None: the smallest level among the first round's clients."""


class WidthRound(RosterRound):
    def __init__(self, strategy: WidthStrategy, round: int, clients: Sequence[ClientSlot]) -> None:
        super().__init__(round, clients)
        self.strategy = strategy
        self.sums = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in strategy.trainable().items()}
        self.counts = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in strategy.trainable().items()}

    def fold(
        self,
        client_id: str,
        tensors: dict[str, torch.Tensor],
        num_samples: int,
        extras: dict[str, torch.Tensor] | None = None,
    ) -> None:
        strategy = self.strategy
        index = strategy.index_for(self.round, strategy.client_level(self.slots[client_id]))
        rows = self._classifier_rows(extras)
        weight = float(num_samples) if strategy.weighting == "samples" else 1.0
        for key in self.sums:
            value = tensors[key].to(torch.float64) * weight
            mask = torch.full_like(value, weight)
            if rows is not None and key in strategy.classifier_keys:
                mask[~rows] = 0
                value = value * (mask != 0)
            if all(kept is None for kept in index[key]):  # the whole tensor (FedAvg, a full-width client): no scatter
                self.sums[key] += value
                self.counts[key] += mask
                continue
            grid = _grid(index[key], self.sums[key].shape)
            self.sums[key].index_put_(grid, value, accumulate=True)
            self.counts[key].index_put_(grid, mask, accumulate=True)
        self.received.append(client_id)

    def _classifier_rows(self, extras: Mapping[str, Tensor] | None) -> Tensor | None:
        if not self.strategy.label_masked:
            return None
        return parse_classes(extras, self.strategy.model.num_classes)


class WidthStrategy(Strategy):
    """Shared machinery; subclasses say which width each client trains and how channels are chosen."""

    program: ClassVar[type[ClientProgram]] = WidthProgram
    personalized: ClassVar[bool] = False
    window = staticmethod(prefix_window)
    weighting: str = "samples"
    label_masked: bool = False
    scaler: bool = False

    def upload_contract(self, slot: ClientSlot) -> UploadContract:
        """The trainable tensors of the sub-model the slot's client trains, and its classes when the classifier
        is label-masked (nothing else is sent)."""
        shapes = self.sub_shapes(self.client_level(slot))
        tensors = {k: TensorSpec(tuple(shapes[k]), v.dtype) for k, v in self.trainable().items()}
        classes = {"classes": self.model.num_classes} if self.label_masked else {}
        return UploadContract(tensors, index_lists=classes)

    def __init__(self, model: ModelSpec, params: StrategyParams, seed: int = 0, width: float = 1.0) -> None:
        super().__init__(model, params, seed)
        self.width = width
        net = seeded_model(model, seed, width)
        self._global = {k: v.detach().clone() for k, v in net.state_dict().items()}
        linears = [name for name, m in net.named_modules() if isinstance(m, nn.Linear)]
        self.classifier_keys = {f"{linears[-1]}.weight", f"{linears[-1]}.bias"} if linears else set()
        self._shapes: dict[float, dict[str, torch.Size]] = {}

    @classmethod
    def client_width(cls, params: BaseModel, level: float) -> float:
        """The width rate a client assigned ``level`` trains."""
        return level

    @classmethod
    def client_model(cls, model: ModelSpec, params: BaseModel, level: float) -> nn.Module:
        """The dense model at the client's width, as ``WidthProgram`` builds it."""
        width = cls.client_width(params, level)
        spec = cls.program.Spec.model_construct(strategy=cls.name, model=model, level=width)  # shapes only
        with torch.device("meta"):
            return cls.program.build_model(spec)

    def client_level(self, slot: ClientSlot) -> float:
        return slot.level

    def spec_fields(self) -> dict[str, object]:
        """What a subclass's client spec adds to ``WidthSpec``'s fields (a FedProx-style ``mu``, say)."""
        return {}

    def trained_level(self, slot: ClientSlot) -> float:
        return self.client_level(slot)

    def trainable(self) -> dict[str, Tensor]:
        return {k: v for k, v in self._global.items() if not is_norm_statistic(k)}

    def sub_shapes(self, level: float) -> dict[str, torch.Size]:
        if level not in self._shapes:
            if not 0 < level <= self.width:
                raise ValueError(f"{self.name}: client level {level} must be in (0, {self.width}]")
            with torch.device("meta"):
                net = build_model(self.model.arch, self.model.num_classes, self.model.in_channels, width=level)
            self._shapes[level] = {k: v.shape for k, v in net.state_dict().items()}
        return self._shapes[level]

    def index_for(self, round: int, level: float) -> dict[str, Index]:
        return submodel_index(self._global, self.sub_shapes(level), round, self.window)

    def configure(self, round: int, clients: Sequence[ClientSlot]) -> dict[str, Assignment]:
        out = {}
        # One copy per level, shared by its devices (index_for is a function of round and level): 1,000 FedAvg
        # devices were 1,000 copies of the model, each encoded on its own by the dispatcher.
        sub_models: dict[float, dict[str, Tensor]] = {}
        for slot in clients:
            level = self.client_level(slot)
            if level not in sub_models:
                index = self.index_for(round, level)
                sub_models[level] = {k: extract(v, index[k]) for k, v in self._global.items()}
            spec = self.program.Spec(
                strategy=self.name,
                model=self.model,
                level=level,
                scaler=self.scaler,
                send_classes=self.label_masked,
                **self.spec_fields(),
            )
            out[slot.client_id] = Assignment(spec, sub_models[level])
        return out

    def open_round(self, round: int, clients: Sequence[ClientSlot]) -> RoundAggregate:
        for slot in clients:
            self.sub_shapes(self.client_level(slot))
        return WidthRound(self, round, clients)

    def close_round(self, aggregate: RoundAggregate) -> None:
        if not isinstance(aggregate, WidthRound) or aggregate.strategy is not self:
            raise TypeError(f"{self.name} can only close its own rounds")
        for key, total in aggregate.sums.items():
            count = aggregate.counts[key]
            held = count > 0
            updated = self._global[key].clone()
            updated[held] = (total[held] / count[held]).to(updated.dtype)
            self._global[key] = updated

    def global_state(self) -> dict[str, Tensor]:
        return dict(self._global)

    def global_model(self) -> nn.Module:
        net = build_model(self.model.arch, self.model.num_classes, self.model.in_channels, width=self.width)
        net.load_state_dict(self._global)
        return net

    def load_norm_statistics(self, statistics: Mapping[str, Tensor]) -> None:
        for key, value in statistics.items():
            if key not in self._global:
                raise KeyError(f"{key!r} is not a buffer of the global model")
            self._global[key] = value.detach().clone()

    def state_dict(self) -> dict[str, Tensor]:
        return {f"global.{k}": v for k, v in self._global.items()}

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        loaded = {k.removeprefix("global."): v for k, v in state.items() if k.startswith("global.")}
        if loaded.keys() != self._global.keys():
            differ = sorted(loaded.keys() ^ self._global.keys())
            raise KeyError(f"{self.name} state does not match the model: {', '.join(differ[:5])}")
        self._global = {k: v.detach().clone() for k, v in loaded.items()}


class HeteroFL(WidthStrategy):
    name: ClassVar[str] = "heterofl"
    Params: ClassVar[type[WidthParams]] = WidthParams
    levels: ClassVar[LevelScale] = WIDTH

    def __init__(self, model: ModelSpec, params: WidthParams, seed: int = 0) -> None:
        super().__init__(model, params, seed)
        self.weighting = params.weighting
        self.label_masked = params.label_masked_classifier
        self.scaler = params.scaler


class FedRolex(HeteroFL):
    name: ClassVar[str] = "fedrolex"
    window = staticmethod(rolling_window)


class FedAvg(WidthStrategy):
    """Sample-weighted FedAvg of the full model; every client trains it whatever its level."""

    name: ClassVar[str] = "fedavg"
    Params: ClassVar[type[FedAvgParams]] = FedAvgParams
    levels: ClassVar[LevelScale] = NONE
    aligned_updates: ClassVar[bool] = True
    params: FedAvgParams

    @classmethod
    def client_width(cls, params: BaseModel, level: float) -> float:
        return 1.0

    def client_level(self, slot: ClientSlot) -> float:
        return 1.0

    def open_round(self, round: int, clients: Sequence[ClientSlot]) -> RoundAggregate:
        if self.params.rule == "mean":
            return super().open_round(round, clients)
        return BufferedRound(self, round, clients)

    def close_round(self, aggregate: RoundAggregate) -> None:
        if not isinstance(aggregate, BufferedRound) or aggregate.strategy is not self or not aggregate.uploads:
            super().close_round(aggregate)
            return
        params = self.params
        combined = buffered_aggregate(params.rule, aggregate.uploads, aggregate.weights, params.trim, params.byzantine)
        for key, value in combined.items():
            self._global[key] = value.to(self._global[key].dtype)


class BufferedRound(WidthRound):
    """A FedAvg round that also keeps every upload, for a robust rule at close."""

    def __init__(self, strategy: WidthStrategy, round: int, clients: Sequence[ClientSlot]) -> None:
        super().__init__(strategy, round, clients)
        self.uploads: list[dict[str, Tensor]] = []
        self.weights: list[float] = []

    def fold(
        self,
        client_id: str,
        tensors: dict[str, torch.Tensor],
        num_samples: int,
        extras: dict[str, torch.Tensor] | None = None,
    ) -> None:
        super().fold(client_id, tensors, num_samples, extras)
        self.uploads.append({k: tensors[k] for k in self.sums})
        self.weights.append(float(num_samples))


class FedAvgSmall(WidthStrategy):
    """FedAvg of the smallest model: what a fleet does when every device must fit one model."""

    name: ClassVar[str] = "fedavg_small"
    Params: ClassVar[type[FedAvgSmallParams]] = FedAvgSmallParams
    levels: ClassVar[LevelScale] = WIDTH
    params: FedAvgSmallParams

    def __init__(self, model: ModelSpec, params: FedAvgSmallParams, seed: int = 0) -> None:
        super().__init__(model, params, seed, width=params.level or 1.0)
        self._fixed = params.level is not None

    @classmethod
    def client_width(cls, params: FedAvgSmallParams, level: float) -> float:
        """``params.level`` when fixed; else at most ``level`` (the first round's smallest level wins)."""
        return level if params.level is None else params.level

    @classmethod
    def level_label(cls, params: FedAvgSmallParams, level: float) -> str:
        if params.level is None:
            return f"width <= {level:g} (the first round's smallest)"
        return f"width {params.level:g} (fixed)"

    def client_level(self, slot: ClientSlot) -> float:
        return self.width

    def configure(self, round: int, clients: Sequence[ClientSlot]) -> dict[str, Assignment]:
        if not self._fixed and clients:
            self._shrink(min(slot.level for slot in clients))
        return super().configure(round, clients)

    def open_round(self, round: int, clients: Sequence[ClientSlot]) -> RoundAggregate:
        # The engine opens the round before it configures it: fix the width first, or the aggregate
        # would be shaped for the full model.
        if not self._fixed and clients:
            self._shrink(min(slot.level for slot in clients))
        return super().open_round(round, clients)

    def _shrink(self, level: float) -> None:
        """Fix the model width at the first round's smallest level (once; later rounds keep it)."""
        self._fixed = True
        if level != self.width:
            WidthStrategy.__init__(self, self.model, self.params, self.seed, width=level)

    def state_dict(self) -> dict[str, Tensor]:
        return {
            **super().state_dict(),
            "width": torch.tensor([self.width], dtype=torch.float64),
            "fixed": torch.tensor([self._fixed]),
        }

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """Restore the width only once it was fixed: the initial state (round 0) must not fix it at 1.

        A run directory starts from the round-0 state; loading it used to fix the width at 1.0, so
        fedavg_small trained the full model under the engine. States without ``fixed`` are older and fixed.
        """
        if "width" not in state:
            raise KeyError("fedavg_small state lacks 'width'")
        fixed = bool(state["fixed"][0]) if "fixed" in state else True
        if fixed:
            self._shrink(float(state["width"][0]))
        super().load_state_dict({k: v for k, v in state.items() if k not in ("width", "fixed")})
