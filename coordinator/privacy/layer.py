"""DP-FedAvg around a strategy: clip orders out, uniform sum of clipped contributions in, noise once per round.

:class:`PrivateStrategy` wraps a supported strategy (:mod:`.support`). Its assignments carry the clip order
(``ClientSpec.clip``); each upload is the device's contribution, what it was sent plus its clipped update
(``device_agent.training.clipping``), which :class:`PrivateRound` rebuilds in the full-rank space, checks
against the clip norm again (a device that did not clip is refused, ``over_clip_norm``) and adds to one float64
sum. At the close the new global model is

    W' = (1/k) * (sum_i contribution_i + N(0, z_u^2 C^2 I))

over the k accepted devices, written back into the wrapped strategy, whose own aggregation is not used
(docs/privacy.md derives it for FedHM). The ledger and the adaptive clip norm are part of the state dict, so
they are committed with the round and a resumed run restores them exactly.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from coordinator.algorithms.aggregation import UpdateRejected
from coordinator.privacy.accountant import Ledger, RoundCharge, calibrate, planned_epsilon
from coordinator.privacy.adaptive import default_count_noise, next_clip, update_noise_multiplier
from coordinator.privacy.noise import RoundNoise
from coordinator.privacy.settings import PrivacySettings
from coordinator.strategies.base import Assignment, ClientSlot, RosterRound, RoundAggregate, Strategy
from coordinator.strategies.upload_contract import UploadContract
from device_agent.clients.base import is_norm_statistic
from device_agent.clients.spec import ClipOrder
from device_agent.common.tensor_spec import TensorSpec
from device_agent.layers.factorized import factors_to_matrices, matrix_to_weight
from device_agent.training.clipping import factor_pairs
from device_agent.training.local_round import UNCLIPPED

log = logging.getLogger("fedfleet.privacy")

CLIP_SLACK = 1e-3
"""Relative slack on the clip-norm check: a float32 upload rebuilt in float64 lands a rounding error away."""


def full_rank(tensors: Mapping[str, Tensor], shapes: Mapping[str, torch.Size]) -> dict[str, Tensor]:
    """The float tensors of ``tensors`` in float64, each factor pair as its dense ``<layer>.weight`` (of ``shapes``)."""
    pairs = factor_pairs(tensors)
    in_pairs = {k for pair in pairs.values() for k in pair}
    out = {
        k: v.to(torch.float64)
        for k, v in tensors.items()
        if k not in in_pairs and v.is_floating_point() and not is_norm_statistic(k)
    }
    for layer, (reduce_key, expand_key) in pairs.items():
        a, b = factors_to_matrices(tensors[reduce_key].to(torch.float64), tensors[expand_key].to(torch.float64))
        out[f"{layer}.weight"] = matrix_to_weight(a @ b, shapes[f"{layer}.weight"])
    return out


def upload_shapes(sent: Mapping[str, Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """What a clipped upload holds: the sent float tensors, each factor pair at twice its rank."""
    shapes = {
        k: (tuple(v.shape), v.dtype) for k, v in sent.items() if v.is_floating_point() and not is_norm_statistic(k)
    }
    for reduce_key, expand_key in factor_pairs(sent).values():
        (r, *rest), dtype = shapes[reduce_key]
        shapes[reduce_key] = ((2 * r, *rest), dtype)
        (o, r2, *tail), dtype = shapes[expand_key]
        shapes[expand_key] = ((o, 2 * r2, *tail), dtype)
    return shapes


@dataclass
class LevelReference:
    """What every device at one level was sent: the shapes its upload must have and the full-rank model it holds."""

    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]
    dense: dict[str, Tensor]


class PrivateRound(RosterRound):
    """One round's uniform sum of clipped contributions (memory: one float64 model)."""

    def __init__(
        self,
        round: int,
        clients: Sequence[ClientSlot],
        references: Mapping[float, LevelReference],
        dense_shapes: Mapping[str, torch.Size],
        clip: float,
        report_unclipped: bool,
    ) -> None:
        super().__init__(round, clients)
        self.references = dict(references)
        self.dense_shapes = dict(dense_shapes)
        self.clip = clip
        self.report_unclipped = report_unclipped
        self.sums: dict[str, Tensor] = {}
        self.unclipped = 0
        self.distributed: tuple[int, int] | None = None
        """(survivors, participants) when the devices added the noise themselves (secure aggregation)."""

    def _contribution(self, client_id: str, tensors: Mapping[str, Tensor], num_samples: int) -> dict[str, Tensor]:
        """The upload (held to its contract by the gate: factor pairs at twice the rank) as its full-rank update,
        refused when over the clip norm the round asked for."""
        reference = self.references[self.slot_of(client_id, num_samples).level]
        contribution = full_rank(tensors, self.dense_shapes)
        norm = math.sqrt(sum(float((contribution[k] - v).square().sum()) for k, v in reference.dense.items()))
        if norm > self.clip * (1 + CLIP_SLACK) + 1e-9:
            raise UpdateRejected(
                f"update norm {norm:.4g} exceeds the clip norm {self.clip:.4g} this round asked for: "
                "the device did not clip (privacy)",
                "over_clip_norm",
            )
        return contribution

    def _bit(self, extras: Mapping[str, Tensor] | None) -> int:
        if not self.report_unclipped:
            return 0
        bit = (extras or {}).get(UNCLIPPED)
        if not isinstance(bit, Tensor) or bit.dtype != torch.int64 or bit.shape != (1,) or int(bit) not in (0, 1):
            raise UpdateRejected(f"{UNCLIPPED!r}: adaptive clipping needs the 0/1 bit as one int64", "missing_tensor")
        return int(bit)

    def check(
        self,
        client_id: str,
        tensors: dict[str, Tensor],
        num_samples: int,
        extras: dict[str, Tensor] | None = None,
    ) -> None:
        self._contribution(client_id, tensors, num_samples)
        self._bit(extras)

    def fold(
        self,
        client_id: str,
        tensors: dict[str, Tensor],
        num_samples: int,
        extras: dict[str, Tensor] | None = None,
    ) -> None:
        for key, value in self._contribution(client_id, tensors, num_samples).items():
            if key in self.sums:
                self.sums[key].add_(value)
            else:
                self.sums[key] = value.clone()
        self.unclipped += self._bit(extras)
        self.received.append(client_id)


@dataclass(frozen=True)
class RoundRelease:
    """What one private round released, for the metrics line."""

    epsilon: float
    delta: float
    clip_norm: float
    noise_multiplier: float
    unclipped_fraction: float | None


class PrivateStrategy(Strategy, register=False):
    """``inner`` with user-level DP (module doc). ``noise_multiplier`` is z, resolved from the settings."""

    def __init__(
        self, inner: Strategy, settings: PrivacySettings, noise_multiplier: float, expected_participants: int
    ) -> None:
        self.Params = inner.Params  # type: ignore[misc]
        super().__init__(inner.model, inner.params, inner.seed)
        self.inner = inner
        self.name = inner.name  # type: ignore[misc]
        self.program = inner.program  # type: ignore[misc]
        self.personalized = inner.personalized  # type: ignore[misc]
        self.levels = inner.levels  # type: ignore[misc]
        self.aligned_updates = False  # type: ignore[misc]  # the gate's cross-device checks are off (docs/privacy.md)
        self.client_model = inner.client_model  # type: ignore[method-assign]
        self.settings = settings
        self.adaptive = settings.clip if settings.clip.adaptive else None
        self.expected_participants = expected_participants
        self.clip_norm = settings.clip.first_norm
        self._set_noise(noise_multiplier)
        self.ledger = Ledger(settings.delta)
        self.last_release: RoundRelease | None = None
        self._fraction: float | None = None
        self._realized: float | None = None
        """The last round's noise multiplier when the devices added the noise (fewer survivors: less noise)."""
        self._references: dict[float, LevelReference] = {}
        """The open round's, per level (:meth:`open_round`): what its uploads are held to."""

    def _set_noise(self, noise_multiplier: float) -> None:
        """z for the pair (update, count); the update gets z, or z_update of the adaptive split."""
        self.noise_multiplier = noise_multiplier
        self.count_noise: float | None = None
        self.update_noise = noise_multiplier
        if self.adaptive is not None:
            self.count_noise = self.adaptive.count_noise or default_count_noise(
                self.expected_participants, noise_multiplier
            )
            self.update_noise = update_noise_multiplier(noise_multiplier, self.count_noise)

    def upload_contract(self, slot: ClientSlot) -> UploadContract:
        """What the device sent for the slot's level clipped (:func:`upload_shapes`: factor pairs at twice their
        rank), the inner strategy's side information, and the one-bit unclipped report when clipping adapts."""
        inner = self.inner.upload_contract(slot)
        reference = self._references.get(slot.level)
        if reference is None:
            raise RuntimeError(f"private {self.name}: no round open at level {slot.level} (call open_round first)")
        shapes = reference.shapes
        bit = {UNCLIPPED: TensorSpec((1,), torch.int64)} if self.adaptive is not None else {}
        tensors = {k: TensorSpec(shape, dtype) for k, (shape, dtype) in shapes.items()}
        return UploadContract(tensors, {**inner.extras, **bit}, inner.index_lists)

    def trained_level(self, slot: ClientSlot) -> float:
        return self.inner.trained_level(slot)

    def configure(self, round: int, clients: Sequence[ClientSlot]) -> dict[str, Assignment]:
        order = ClipOrder(norm=self.clip_norm, report_unclipped=self.adaptive is not None)
        return {
            client: Assignment(assignment.spec.model_copy(update={"clip": order}), assignment.tensors)
            for client, assignment in self.inner.configure(round, clients).items()
        }

    def open_round(self, round: int, clients: Sequence[ClientSlot]) -> RoundAggregate:
        shapes = {k: v.shape for k, v in self.inner.global_state().items()}
        sent = self.inner.configure(round, clients)
        references: dict[float, LevelReference] = {}
        for slot in clients:
            if slot.level not in references:
                tensors = sent[slot.client_id].tensors
                references[slot.level] = LevelReference(upload_shapes(tensors), full_rank(tensors, shapes))
        self._references = references
        return PrivateRound(round, clients, references, shapes, self.clip_norm, self.adaptive is not None)

    def close_round(self, aggregate: RoundAggregate) -> None:
        if not isinstance(aggregate, PrivateRound):
            raise TypeError(f"private {self.name} cannot close a {type(aggregate).__name__}")
        k = len(aggregate.received)
        if not k:
            return
        noise = RoundNoise()
        std = self.update_noise * aggregate.clip
        self._realized = None
        if aggregate.distributed is not None:  # each of n devices added z C / sqrt(n); m of them survived
            survivors, participants = aggregate.distributed
            std, self._realized = 0.0, self.noise_multiplier * math.sqrt(survivors / participants)
        state = self.inner.state_dict()
        for key, total in aggregate.sums.items():
            noised = (total + noise.normal(tuple(total.shape), std)) / k
            state[f"global.{key}"] = noised.to(state[f"global.{key}"].dtype)
        self.inner.load_state_dict(state)
        fraction = None
        if self.adaptive is not None:
            assert self.count_noise is not None
            fraction = (aggregate.unclipped + float(noise.normal((1,), self.count_noise))) / k
            self.clip_norm = next_clip(self.clip_norm, fraction, self.adaptive.quantile, self.adaptive.learning_rate)
        self._fraction = fraction

    def charge(self, population: int, sample: int) -> RoundRelease:
        """Account one round drawn from ``population`` devices, ``sample`` of them (call once per drawn round)."""
        z = self.noise_multiplier if self._realized is None else self._realized
        self.ledger.charges.append(RoundCharge(population, sample, z / 2))
        self.last_release = RoundRelease(self.ledger.epsilon(), self.settings.delta, self.clip_norm, z, self._fraction)
        self._fraction, self._realized = None, None
        return self.last_release

    def round_charge(self, population: int, sample: int) -> RoundCharge:
        return RoundCharge(population, sample, self.noise_multiplier / 2)

    def global_state(self) -> dict[str, Tensor]:
        return self.inner.global_state()

    def global_model(self) -> torch.nn.Module:
        return self.inner.global_model()

    def load_norm_statistics(self, statistics: Mapping[str, Tensor]) -> None:
        self.inner.load_norm_statistics(statistics)

    def state_dict(self) -> dict[str, Tensor]:
        return {
            **self.inner.state_dict(),
            "privacy.ledger": self.ledger.to_tensor(),
            "privacy.clip_norm": torch.tensor([self.clip_norm], dtype=torch.float64),
            "privacy.noise_multiplier": torch.tensor([self.noise_multiplier], dtype=torch.float64),
        }

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        self.inner.load_state_dict({k: v for k, v in state.items() if not k.startswith("privacy.")})
        if "privacy.ledger" in state:  # a fresh run's first state was written by the bare strategy
            self.ledger = Ledger.from_tensor(self.settings.delta, state["privacy.ledger"])
            self.clip_norm = float(state["privacy.clip_norm"])
            saved = float(state["privacy.noise_multiplier"])
            if not math.isclose(saved, self.noise_multiplier, rel_tol=1e-9):
                log.warning(
                    "privacy: resuming with the run's noise multiplier %.6g, not %.6g", saved, self.noise_multiplier
                )
                self._set_noise(saved)


def private_strategy(
    inner: Strategy, settings: PrivacySettings, devices: int, participation: float, rounds: int
) -> PrivateStrategy:
    """``inner`` under ``settings`` for a fleet of ``devices`` asking ``participation`` of them for ``rounds`` rounds.

    With ``target_epsilon`` the noise multiplier is calibrated to the planned draw (all devices eligible); fewer
    eligible devices in a round raise its sampling rate, and the ledger charges what really happened.
    """
    sample = max(1, math.ceil(participation * devices))
    return PrivateStrategy(inner, settings, private_strategy_noise(settings, devices, sample, rounds), sample)


def plan_statement(settings: PrivacySettings, devices: int, participation: float, rounds: int) -> str:
    """The sentence ``coordinator plan`` prints: the epsilon the configured run reaches if every round runs."""
    sample = max(1, math.ceil(participation * devices))
    z = private_strategy_noise(settings, devices, sample, rounds)
    eps = planned_epsilon(devices, sample, rounds, z, settings.delta)
    budget = settings.budget
    stop = "" if budget is None or eps <= budget + 1e-6 else f"; the budget {budget:g} stops it earlier"
    return (
        f"privacy: user-level (epsilon, delta) = ({eps:.3g}, {settings.delta:g}) after {rounds} rounds, noise "
        f"multiplier {z:.4g}, {sample} of {devices} devices drawn per round{stop}"
    )


def private_strategy_noise(settings: PrivacySettings, devices: int, sample: int, rounds: int) -> float:
    """z: the configured multiplier, or the one calibrated to ``target_epsilon`` for the planned draw."""
    if settings.noise_multiplier is not None:
        return settings.noise_multiplier
    assert settings.target_epsilon is not None
    return calibrate(devices, sample, rounds, settings.target_epsilon, settings.delta)


__all__ = [
    "CLIP_SLACK",
    "LevelReference",
    "PrivateRound",
    "PrivateStrategy",
    "RoundRelease",
    "full_rank",
    "plan_statement",
    "private_strategy",
    "upload_shapes",
]
