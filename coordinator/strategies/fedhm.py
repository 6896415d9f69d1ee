"""FedHM (seed 004): heterogeneous low-rank clients, one full-rank global model.

configure: one spectral decomposition per factorized layer serves every rank level in the
round (``coordinator.algorithms.lowrank.factorize``), also at round 1, so no client starts from
random factors. aggregate: factors are rebuilt into full-rank weights and folded as they arrive
(``StreamingAggregator``, memory O(model)), with the paper's softmax(gamma / tau) weighting by
default.

BatchNorm policy: running statistics are never averaged (clients do not send them). The caller
recomputes them on its own data for the global model (HeteroFL's static BN) and hands them back
through :meth:`load_norm_statistics`; they then travel to clients with the next assignment,
where they only matter for evaluation (training uses batch statistics).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar, Literal

import torch
from pydantic import BaseModel, Field
from torch import nn

from coordinator.algorithms.aggregation import ClassifierRule, StreamingAggregator, parse_classes
from coordinator.algorithms.lowrank import factorize
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
from device_agent.clients.base import ClientProgram, is_norm_statistic
from device_agent.clients.fedhm import FedHMProgram
from device_agent.layers.hybrid import factorization_plan


class FedHMParams(StrategyParams):
    weighting: Literal["paper", "reference", "samples", "uniform"] = "paper"
    """paper: softmax(gamma/tau); reference: the FedHM code's softmax(-(1/gamma)/tau); samples; uniform."""
    temperature: float = Field(1.0, gt=0)
    global_as_pseudo_client: bool = False
    """Add the previous global model as a gamma = 1 client when none took part (the reference does)."""
    frobenius_decay: float = Field(5e-4, ge=0)
    """Frobenius decay strength on factors; factors get no plain L2."""
    label_masked_classifier: ClassifierRule = ClassifierRule.OFF
    """off: every row averaged; reference: a gamma < 1 client adds alpha_p * W_p[c] only for its
    classes, alpha not renormalised (the FedHM code); renormalised: per row over its holders."""


class FedHMRound(RosterRound):
    def __init__(
        self, round: int, clients: Sequence[ClientSlot], aggregator: StreamingAggregator, num_classes: int = 0
    ) -> None:
        super().__init__(round, clients)
        self.aggregator = aggregator
        self.num_classes = num_classes

    def fold(
        self,
        client_id: str,
        tensors: dict[str, torch.Tensor],
        num_samples: int,
        extras: dict[str, torch.Tensor] | None = None,
    ) -> None:
        level = self.slots[client_id].level
        self.aggregator.add(tensors, level, num_samples, self._rows(level, extras))
        self.received.append(client_id)

    def _rows(self, level: float, extras: Mapping[str, torch.Tensor] | None) -> torch.Tensor | None:
        """The classifier rows a gamma < 1 client trained, when the round masks them."""
        if not self.aggregator.classifier_keys or level == 1:
            return None
        return parse_classes(extras, self.num_classes)


class FedHM(Strategy):
    name: ClassVar[str] = "fedhm"
    Params: ClassVar[type[FedHMParams]] = FedHMParams
    program: ClassVar[type[ClientProgram]] = FedHMProgram
    personalized: ClassVar[bool] = False
    levels: ClassVar[LevelScale] = RANK
    aligned_updates: ClassVar[bool] = True
    params: FedHMParams

    def __init__(self, model: ModelSpec, params: FedHMParams, seed: int = 0) -> None:
        super().__init__(model, params, seed)
        self.plan = factorization_plan(model.arch, model.num_classes, model.in_channels)
        net = seeded_model(model, seed)
        self._global = {k: v.detach().clone() for k, v in net.state_dict().items()}
        linears = [name for name, m in net.named_modules() if isinstance(m, nn.Linear)]
        self.classifier_keys = frozenset({f"{linears[-1]}.weight", f"{linears[-1]}.bias"} & self._global.keys())
        self._contracts: dict[float, UploadContract] = {}

    @classmethod
    def client_model(cls, model: ModelSpec, params: BaseModel, level: float) -> nn.Module:
        """The hybrid at rank ratio gamma = ``level``, as ``FedHMProgram`` builds it."""
        spec = cls.program.Spec.model_construct(  # shapes only: a subclass's extra spec fields do not change them
            strategy=cls.name, model=model, level=level, frobenius_decay=params.frobenius_decay, send_classes=False
        )  # type: ignore[attr-defined]
        with torch.device("meta"):
            return cls.program.build_model(spec)

    def configure(self, round: int, clients: Sequence[ClientSlot]) -> dict[str, Assignment]:
        levels = factorize(self._global, self.plan, {slot.level for slot in clients})
        return {
            slot.client_id: Assignment(
                self.program.Spec(
                    strategy=self.name,
                    model=self.model,
                    level=slot.level,
                    frobenius_decay=self.params.frobenius_decay,
                    send_classes=self.params.label_masked_classifier is not ClassifierRule.OFF and slot.level < 1,
                    **self.spec_fields(),
                ),
                dict(levels[slot.level]),
            )
            for slot in clients
        }

    def spec_fields(self) -> dict[str, object]:
        """What a subclass's client spec adds to ``FedHMSpec``'s fields (a proximal ``mu``, say): a FedHM variant
        is a subclass with its own ``name``, ``program`` and these, not a copy of :meth:`configure`."""
        return {}

    def upload_contract(self, slot: ClientSlot) -> UploadContract:
        """What ``FedHMProgram.upload`` sends at the slot's rank ratio: every state entry but the BN statistics
        (factor pairs for the factorized layers below gamma 1), and its classes when the round masks the
        classifier rows of gamma < 1 clients."""
        if slot.level not in self._contracts:
            state = self.client_model(self.model, self.params, slot.level).state_dict()
            masked = self.params.label_masked_classifier is not ClassifierRule.OFF and slot.level < 1
            self._contracts[slot.level] = UploadContract.like(
                {k: v for k, v in state.items() if not is_norm_statistic(k)},
                index_lists={"classes": self.model.num_classes} if masked else None,
            )
        return self._contracts[slot.level]

    def open_round(self, round: int, clients: Sequence[ClientSlot]) -> RoundAggregate:
        aggregator = StreamingAggregator(
            self._global,
            self.plan,
            self.params.weighting,
            self.params.temperature,
            self.params.global_as_pseudo_client,
            self.params.label_masked_classifier,
            self.classifier_keys,
        )
        return FedHMRound(round, clients, aggregator, self.model.num_classes)

    def close_round(self, aggregate: RoundAggregate) -> None:
        if not isinstance(aggregate, FedHMRound):
            raise TypeError(f"fedhm cannot close a {type(aggregate).__name__}")
        if aggregate.received:
            self._global = aggregate.aggregator.result()

    def global_state(self) -> dict[str, torch.Tensor]:
        return dict(self._global)

    def load_norm_statistics(self, statistics: Mapping[str, torch.Tensor]) -> None:
        for key, value in statistics.items():
            if key not in self._global:
                raise KeyError(f"{key!r} is not a buffer of the global model")
            self._global[key] = value.detach().clone()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"global.{k}": v for k, v in self._global.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        loaded = {k.removeprefix("global."): v for k, v in state.items() if k.startswith("global.")}
        if loaded.keys() != self._global.keys():
            missing = sorted(self._global.keys() - loaded.keys())
            raise KeyError(f"fedhm state does not match the model (missing: {', '.join(missing) or 'none'})")
        self._global = {k: v.detach().clone() for k, v in loaded.items()}
