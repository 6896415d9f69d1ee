"""The strategy interface: what every federated algorithm looks like to the rounds engine.

A strategy is pure tensor code. ``configure`` says what each client receives for a round,
``open_round`` returns an aggregate that folds uploads as they arrive, ``close_round`` turns it
into the next state. No MQTT, files or clocks: the same object runs in a unit test, in the
in-process simulation and behind the real coordinator.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from pydantic import BaseModel, ConfigDict
from torch import nn

from coordinator.algorithms.aggregation import UpdateRejected
from coordinator.strategies.levels import NONE, LevelScale
from coordinator.strategies.upload_contract import UploadContract
from device_agent.clients.base import ClientProgram
from device_agent.clients.spec import ClientSpec, ModelSpec
from device_agent.common.registry import Registry
from device_agent.models import build_model

ENTRY_POINT_GROUP = "fedfleet.strategies"
STRATEGIES: Registry[type[Strategy]] = Registry("strategy", "coordinator.strategies", ENTRY_POINT_GROUP)
"""Server strategies by name: this package's modules, and other packages' ``fedfleet.strategies`` entry points."""


@dataclass(frozen=True)
class ClientSlot:
    """One participant of a round as the server sees it.

    ``level`` is the FedHM rank ratio gamma or the HeteroFL/FedRolex width rate; 1.0 is the full model.
    """

    client_id: str
    level: float
    num_samples: int


@dataclass
class Assignment:
    """What one client receives for one round: its typed spec and the tensors it starts from."""

    spec: ClientSpec
    tensors: dict[str, torch.Tensor]


class StrategyParams(BaseModel):
    """Base of every strategy's ``Params``: unknown keys are errors, not silently ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class RoundAggregate(ABC):
    """One open round. Uploads are folded (or, for cheap personalized vectors, buffered) on arrival.

    The upload gate holds each upload to :meth:`Strategy.upload_contract` (names, shapes, dtypes, finite and
    bounded values) before :meth:`check`, so neither repeats any of that. Checking and folding are two steps
    so the engine can journal an upload between them: an upload :meth:`check` accepts is durable before it
    counts, and one it refuses never counts.
    """

    def check(  # noqa: B027
        self,
        client_id: str,
        tensors: dict[str, torch.Tensor],
        num_samples: int,
        extras: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """What only this round can judge of an upload that met its contract (who sends it, a privacy clip
        norm); changes nothing. Raises ``coordinator.algorithms.aggregation.UpdateRejected`` naming the problem.
        """

    @abstractmethod
    def fold(
        self,
        client_id: str,
        tensors: dict[str, torch.Tensor],
        num_samples: int,
        extras: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Fold in an upload that met its contract and :meth:`check` accepted."""

    def add(
        self,
        client_id: str,
        tensors: dict[str, torch.Tensor],
        num_samples: int,
        extras: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Check, then fold: for callers that keep no journal in between and hold uploads to their contract
        themselves (tests, examples: ``strategy.upload_contract(slot).check(tensors, extras)``)."""
        self.check(client_id, tensors, num_samples, extras)
        self.fold(client_id, tensors, num_samples, extras)


class RosterRound(RoundAggregate):
    """A round that knows its participants: uploads from strangers or repeat senders are rejected."""

    def __init__(self, round: int, clients: Sequence[ClientSlot]) -> None:
        self.round = round
        self.slots = {slot.client_id: slot for slot in clients}
        self.received: list[str] = []

    def check(
        self,
        client_id: str,
        tensors: dict[str, torch.Tensor],
        num_samples: int,
        extras: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """The sender is a participant that has not uploaded yet, with at least one sample."""
        self.slot_of(client_id, num_samples)

    def slot_of(self, client_id: str, num_samples: int) -> ClientSlot:
        """The sender's slot; call before validating, and append to ``received`` after folding."""
        if client_id not in self.slots:
            raise UpdateRejected(f"client {client_id!r} is not part of round {self.round}")
        if client_id in self.received:
            raise UpdateRejected(f"client {client_id!r} already uploaded for round {self.round}")
        if num_samples < 1:
            raise UpdateRejected(f"client {client_id!r}: num_samples must be >= 1, got {num_samples}")
        return self.slots[client_id]


def seeded_model(model: ModelSpec, seed: int, width: float = 1.0) -> torch.nn.Module:
    """A freshly initialized model, the same for a given seed, without touching the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build_model(model.arch, model.num_classes, model.in_channels, width=width)


def state_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer of ``model`` (meta tensors too): what a full state dict weighs."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


class Strategy(ABC):
    """A federated algorithm: per-round payloads out, uploads in, state in between.

    ``configure`` must not change the strategy's state: the simulation calls it again to
    rebuild the model a client holds for personalized evaluation.
    """

    name: ClassVar[str]
    Params: ClassVar[type[BaseModel]]
    program: ClassVar[type[ClientProgram]]
    """The device side of this strategy; ``configure`` builds ``program.Spec`` specs."""
    personalized: ClassVar[bool]
    levels: ClassVar[LevelScale] = NONE
    """How ``ClientSlot.level`` is read: a rank ratio (FedHM gamma), a channel width, or none (full model)."""
    aligned_updates: ClassVar[bool] = False
    """Every upload's layers (full rank) sit where the one global model's do, round after round, so an update can
    be compared by direction with last round's (the upload gate's direction check). Not so for rolling or
    nested width windows, nor for personalized strategies, whose honest devices differ on purpose."""

    def __init_subclass__(cls, register: bool = True, **kwargs: object) -> None:
        """A strategy that names itself is registered under that name: no list anywhere to edit.

        ``class Variant(FedAvg, register=False)`` keeps a test double or an experiment out of the registry.
        """
        super().__init_subclass__(**kwargs)
        if register and "name" in cls.__dict__:
            STRATEGIES.register(cls.name, cls)

    def __init__(self, model: ModelSpec, params: BaseModel, seed: int = 0) -> None:
        if not isinstance(params, self.Params):
            raise TypeError(f"{self.name} expects {self.Params.__name__}, got {type(params).__name__}")
        self.model = model
        self.params = params
        self.seed = seed

    def upload_contract(self, slot: ClientSlot) -> UploadContract:
        """What the device of ``slot`` uploads: every tensor's name, shape and dtype, side information too.

        The upload gate holds each upload to it from the payload's header, before decoding, and checks values
        (finite, bounded) for every strategy, so :meth:`open_round`'s aggregate folds without checking again.
        Called after :meth:`open_round` for the round. Default: the trainable parameters of
        :meth:`client_model` at the slot's level (what :meth:`upload_bytes` counts), no side information.
        """
        net = self.client_model(self.model, self.params, slot.level)
        return UploadContract.like({k: p for k, p in net.named_parameters() if p.requires_grad})

    @classmethod
    def client_model(cls, model: ModelSpec, params: BaseModel, level: float) -> nn.Module:
        """The module a client assigned ``level`` trains, built on the meta device (shapes, no values).

        It comes from the builder the client program uses, so the planner sizes what really runs
        on the device. Building it needs no strategy instance (an instance may do real work, e.g.
        FedHM's SVDs). Default: the whole dense model, whatever the level.
        """
        with torch.device("meta"):
            return build_model(model.arch, model.num_classes, model.in_channels)

    @classmethod
    def download_bytes(cls, model: ModelSpec, params: BaseModel, level: float) -> int:
        """What a client at ``level`` receives in a round: by default every parameter and buffer of its model."""
        return state_bytes(cls.client_model(model, params, level))

    @classmethod
    def upload_bytes(cls, model: ModelSpec, params: BaseModel, level: float) -> int:
        """What a client at ``level`` sends back: by default its trainable parameters (BN statistics stay).

        Side information (class lists, embeddings) is a few KiB and not counted.
        """
        net = cls.client_model(model, params, level)
        return sum(p.numel() * p.element_size() for p in net.parameters() if p.requires_grad)

    @classmethod
    def level_label(cls, params: BaseModel, level: float) -> str:
        """What ``level`` means for this strategy's client model, for plan tables: "gamma 1/4", "width 0.5"..."""
        return cls.levels.label(level)

    @classmethod
    def level_problem(cls, level: float) -> str | None:
        """Why no client of this strategy can be assigned ``level`` (None: it can)."""
        return cls.levels.problem(level)

    def trained_level(self, slot: ClientSlot) -> float:
        """The level the client of ``slot`` actually trains (what metrics should record): by default its own."""
        return slot.level

    @abstractmethod
    def configure(self, round: int, clients: Sequence[ClientSlot]) -> dict[str, Assignment]:
        """What each client receives for ``round``, keyed by client id."""

    @abstractmethod
    def open_round(self, round: int, clients: Sequence[ClientSlot]) -> RoundAggregate:
        """An empty aggregate for ``round``; it accepts uploads only from ``clients``."""

    @abstractmethod
    def close_round(self, aggregate: RoundAggregate) -> None:
        """Fold the round's aggregate into the strategy's state."""

    @abstractmethod
    def global_state(self) -> dict[str, torch.Tensor]:
        """The full dense model (``build_model(arch)`` state dict) for evaluation."""

    def global_model(self) -> torch.nn.Module:
        """The global model with :meth:`global_state` loaded (strategies with a smaller global model override)."""
        model = build_model(self.model.arch, self.model.num_classes, self.model.in_channels)
        model.load_state_dict(self.global_state())
        return model

    def personalized_state(self, client_id: str) -> dict[str, torch.Tensor] | None:
        """What the server keeps for one client (None when the strategy is not personalized)."""
        return None

    def forget(self, client_id: str) -> None:  # noqa: B027
        """Drop what the server keeps for a client whose device lost its own part of the model.

        Its next assignment then starts it over as a newcomer (for Factorized-FL: the whole model).
        Strategies that keep nothing per client, or send clients everything anyway, ignore it.
        """

    def load_norm_statistics(self, statistics: Mapping[str, torch.Tensor]) -> None:  # noqa: B027
        """Static BN hook: BatchNorm running statistics the caller recomputed on its own data.

        Statistics need data and strategies hold none, so the caller (simulation or
        coordinator) recalibrates the global model and hands the buffers back here. Strategies
        whose payloads carry no BN statistics ignore them.
        """

    @abstractmethod
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Everything to persist (global and per-client), flat so it can be a safetensors file."""

    @abstractmethod
    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore what :meth:`state_dict` returned."""
