"""What one secure sum is made of, per strategy: the vector every device masks, and how its sum folds into a round.

SecAgg+ sums vectors of one length. A strategy whose aggregate is a (weighted) sum of what devices send runs
under it when every device's contribution can be written in one common vector; the coordinator sends each device
its :class:`~device_agent.agent.secure.Layout` with the setup and folds the unmasked sum into the strategy's round
(docs/secure-aggregation.md, "What each strategy gets"):

- :class:`FlatLayout` (FedAvg, FedAvgSmall): the update's own tensors, trained minus sent; public sample weights.
- :class:`SliceLayout` (HeteroFL, FedRolex): each device's width slice padded into the full tensor with zeros
  (one protocol instance, one sum: the coordinator learns no per-level sum). Who holds which value is public (the
  levels, the survivors, the weights), except a label-masked classifier's rows, whose holders depend on each
  device's classes: those tensors get a count entry each, summed under the same masks.
- :class:`PrivateLayout` (FedAvg under ``privacy``): the clipped update plus the device's share of the DP noise.
- :class:`DenseLayout` (FedHM): each device rebuilds its low-rank layers' dense weights and masks the dense update
  (the full model's size: the bytes grow; the planner counts them), weighted by FedHM's public softmax weights.
- :class:`FineTuneLayout` (ft, lora_homogeneous = FedIT, hetlora with ``weighting: samples``, fedlora): what each
  device uploads as its round folds it: ft's model and FedIT's factors as they are; HetLoRA's factors zero-padded
  to ``max_rank`` (B in effective form, times alpha / r); fedlora's product scale B A rebuilt dense per layer.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from coordinator.algorithms.aggregation import ClassifierRule, log_score
from coordinator.algorithms.lora import ClientFactors
from coordinator.algorithms.lowrank import align, factor_keys
from coordinator.config.secure import SecureAggregation
from coordinator.privacy.layer import PrivateRound, PrivateStrategy
from coordinator.strategies import ClientSlot, RoundAggregate, Strategy
from coordinator.strategies.fedhm import FedHM, FedHMRound
from coordinator.strategies.fedlora import FedLoRA, FineTune, FineTuneRound
from coordinator.strategies.lora_rules import FactorRound, HetLoRA, RankedLoRA
from coordinator.strategies.width import FedAvg, FedAvgSmall, HeteroFL, WidthRound, WidthStrategy
from device_agent.agent.secure import Entry, Layout, place, vector_keys
from device_agent.clients.base import is_norm_statistic
from device_agent.layers.factorized import reconstruct
from device_agent.secagg.quantize import Quantizer


class SecureLayout(ABC):
    """A round's common vector: ``length``, each device's ``layout`` and ``weights``, and ``fold`` of the sum."""

    length: int
    weights: dict[str, float] | None
    """The factor each device scales its contribution by (public, at most 1); None: every device 1."""
    noise: float | None = None
    """The std of the Gaussian noise each device adds per value (distributed DP), None: none."""

    def layout(self, device: str) -> Layout | None:
        """What the device is told with its setup (None: its update's own tensors in key order)."""
        return None

    @abstractmethod
    def fold(self, aggregate: RoundAggregate, total: np.ndarray, survivors: Sequence[str]) -> None:
        """Fold the survivors' unmasked sum into the strategy's round, as if each had uploaded."""

    def weight(self, device: str) -> float:
        return 1.0 if self.weights is None else self.weights[device]


def _split(total: np.ndarray, shapes: Sequence[tuple[int, ...]]) -> list[Tensor]:
    parts, offset = [], 0
    whole = torch.from_numpy(total)
    for shape in shapes:
        size = math.prod(shape)
        parts.append(whole[offset : offset + size].reshape(shape))
        offset += size
    return parts


def _sample_weights(slots: Sequence[ClientSlot]) -> dict[str, float] | None:
    largest = max((slot.num_samples for slot in slots), default=0)
    return {slot.client_id: slot.num_samples / largest for slot in slots} if largest > 0 else None


class FlatLayout(SecureLayout):
    """FedAvg: one model for every device; the mean update lands in the round's sums and counts."""

    def __init__(self, sent: Mapping[str, Tensor], slots: Sequence[ClientSlot], weighted: bool = True) -> None:
        self.keys = vector_keys(sent)
        self.sent = {key: sent[key] for key in self.keys}
        self.length = sum(self.sent[key].numel() for key in self.keys)
        self.weights = _sample_weights(slots) if weighted else None

    def fold(self, aggregate: RoundAggregate, total: np.ndarray, survivors: Sequence[str]) -> None:
        sums, counts = _sums_and_counts(aggregate)
        count = sum(self.weight(device) for device in survivors)
        for key, part in zip(self.keys, _split(total, [tuple(self.sent[k].shape) for k in self.keys]), strict=True):
            sent = self.sent[key].to(torch.float64)
            sums[key] = sums[key] + sent * count + part
            counts[key] = counts[key] + count


class SliceLayout(SecureLayout):
    """HeteroFL, FedRolex: each device's width slice in the full tensor; per-value holders counted.

    A padded zero is not free: the quantizer has no level at 0 (2^bits - 1 levels over [-clip, clip]), so each one
    decodes to ``zero`` (half a step) exactly. The coordinator knows how many devices padded each value (the
    survivors less its holders) and takes their zeros off, so a value held by few devices is as exact as one
    held by all. A label-masked classifier's holders are private (a device's classes): its count entries carry
    ``clip`` per holder, from which the integer count is solved (uniform weighting only: fleet.yaml refuses
    sample weighting with it).
    """

    def __init__(
        self, strategy: WidthStrategy, round_: int, slots: Sequence[ClientSlot], settings: SecureAggregation
    ) -> None:
        self.strategy, self.full = strategy, strategy.trainable()
        self.keys = sorted(self.full)
        self.masked_rows = sorted(strategy.classifier_keys) if strategy.label_masked else []
        self.index = {slot.client_id: strategy.index_for(round_, strategy.client_level(slot)) for slot in slots}
        self.weights = _sample_weights(slots) if strategy.weighting == "samples" else None
        if self.masked_rows and self.weights is not None:
            raise TypeError(
                f"{strategy.name}: a label-masked classifier under secure aggregation needs uniform weights"
            )
        self.shapes = [tuple(self.full[k].shape) for k in [*self.keys, *self.masked_rows]]
        self.length = sum(math.prod(shape) for shape in self.shapes)
        self.clip = settings.clip
        quantizer = Quantizer(clip=settings.clip, bits=settings.bits, devices=max(2, len(slots)))
        self.zero = float(quantizer.decode_sum(quantizer.encode(np.zeros(1)), 1)[0])
        """What one device's 0 decodes to (half a step): subtracted once per device that padded a value."""

    def layout(self, device: str) -> Layout:
        index = self.index[device]

        def entry(key: str, count: bool = False) -> Entry:
            kept = tuple(None if ix is None else tuple(int(i) for i in ix) for ix in index[key])
            by_class = key in self.masked_rows
            return Entry(key=key, shape=tuple(self.full[key].shape), index=kept, count=count, by_class=by_class)

        return Layout(entries=tuple([entry(k) for k in self.keys] + [entry(k, count=True) for k in self.masked_rows]))

    def fold(self, aggregate: RoundAggregate, total: np.ndarray, survivors: Sequence[str]) -> None:
        if not isinstance(aggregate, WidthRound):
            raise TypeError(f"{type(aggregate).__name__} is not a width round")
        split = _split(total, self.shapes)
        parts = dict(zip(self.keys, split[: len(self.keys)], strict=True))
        counted = dict(zip(self.masked_rows, split[len(self.keys) :], strict=True))
        n = len(survivors)
        for key in self.keys:
            if key in counted:  # holders private (a device's classes): clip per holder, zero per other survivor
                holders = torch.round((counted[key] - n * self.zero) / (self.clip - self.zero)).clamp(0, n)
                count = holders
            else:
                holders = sum(self._held(device, key) for device in survivors)
                count = sum(self._held(device, key) * self.weight(device) for device in survivors)
            update = torch.where(count > 0, parts[key] - (n - holders) * self.zero, torch.zeros_like(count))
            aggregate.sums[key] += self.full[key].to(torch.float64) * count + update
            aggregate.counts[key] += count

    def _held(self, device: str, key: str) -> Tensor:
        """1 where ``device``'s slice holds a value of ``key``, else 0."""
        held = torch.zeros(self.full[key].shape, dtype=torch.float64)
        kept = [
            torch.arange(n) if ix is None else ix for ix, n in zip(self.index[device][key], held.shape, strict=True)
        ]
        held[torch.meshgrid(*kept, indexing="ij")] = 1.0
        return held


class DenseLayout(SecureLayout):
    """FedHM: the dense update of every device (low-rank layers rebuilt), weighted by FedHM's public weights."""

    def __init__(
        self, strategy: FedHM, assignments: Mapping[str, Mapping[str, Tensor]], slots: Sequence[ClientSlot]
    ) -> None:
        self.strategy = strategy
        self.full = {
            k: v for k, v in strategy.global_state().items() if v.is_floating_point() and not is_norm_statistic(k)
        }
        self.keys = sorted(self.full)
        self.levels = {slot.client_id: slot.level for slot in slots}
        self.sent = {d: align(assignments[d], strategy.plan) for d in self.levels}
        """What each device was sent, rebuilt into full-rank weights (the device takes its dense update from it)."""
        params = strategy.params
        scores = {
            slot.client_id: log_score(params.weighting, slot.level, max(1, slot.num_samples), params.temperature)
            for slot in slots
        }
        top = max(scores.values())
        self.weights = {d: math.exp(score - top) for d, score in scores.items()}
        self.length = sum(v.numel() for v in self.full.values())

    def layout(self, device: str) -> Layout:
        entries = []
        for key in self.keys:
            layer = key.removesuffix(".weight")
            factored = key.endswith(".weight") and layer in self.strategy.plan and self.levels[device] < 1
            factors = factor_keys(layer) if factored else None
            entries.append(Entry(key=key, shape=tuple(self.full[key].shape), factors=factors))
        return Layout(entries=tuple(entries))

    def fold(self, aggregate: RoundAggregate, total: np.ndarray, survivors: Sequence[str]) -> None:
        if not isinstance(aggregate, FedHMRound):
            raise TypeError(f"{type(aggregate).__name__} is not a FedHM round")
        weight = sum(self.weights[d] for d in survivors)
        parts = _split(total, [tuple(self.full[k].shape) for k in self.keys])
        mean = {}
        for key, part in zip(self.keys, parts, strict=True):
            sent = sum(self.weights[d] * self.sent[d][key].to(torch.float64) for d in survivors)
            mean[key] = ((sent + part) / weight).to(self.full[key].dtype)
        # One full-rank "device" carrying the weighted mean: FedHM's round then averages to exactly it.
        aggregate.aggregator.add(mean, 1.0, 1)


class FineTuneLayout(SecureLayout):
    """ft, lora_homogeneous (FedIT), hetlora (``weighting: samples``), fedlora: every device's upload in the shapes
    of the largest rank, weighted by the strategy's public weights (samples; fedlora: FedHM's softmax of levels).

    - ft and lora_homogeneous: every tensor as uploaded (one shape on every device), trained minus sent.
    - hetlora: a device at rank r pads A (r, in) with zero rows and B (out, r) with zero columns up to
      ``max_rank``, B times its scale alpha / r (the effective form HetLoRA averages): the weighted sum over all
      survivors divided by their weights is HetLoRA's zero-padded average. The rows each holds are public (ranks);
      the padded zeros' half-step offsets are taken off exactly, as :class:`SliceLayout`'s.
    - fedlora: each device's product scale B A per layer, rebuilt dense (the bytes of the dense projections).

    The coordinator adds back what it sent (in the same form) and hands the round the weighted sums, so the
    round closes as if every survivor had uploaded.
    """

    def __init__(
        self,
        strategy: FineTune,
        slots: Sequence[ClientSlot],
        assignments: Mapping[str, Mapping[str, Tensor]],
        settings: SecureAggregation,
    ) -> None:
        self.strategy = strategy
        scores = {slot.client_id: strategy.score(slot.level, max(1, slot.num_samples)) for slot in slots}
        self.top = max(scores.values())
        self.weights = {device: math.exp(score - self.top) for device, score in scores.items()}
        self.entries = {slot.client_id: self._entries(slot.level) for slot in slots}
        self.sent = {device: assignments[device] for device in self.entries}
        first = next(iter(self.entries.values()))
        self.keys, self.shapes = [e.key for e in first], [e.shape for e in first]
        self.length = sum(math.prod(shape) for shape in self.shapes)
        quantizer = Quantizer(clip=settings.clip, bits=settings.bits, devices=max(2, len(slots)))
        self.zero = float(quantizer.decode_sum(quantizer.encode(np.zeros(1)), 1)[0])
        """What one device's padded 0 decodes to (half a step): taken off once per device that padded a value."""

    def _entries(self, level: float) -> tuple[Entry, ...]:
        strategy = self.strategy
        if not isinstance(strategy, (RankedLoRA, FedLoRA)):
            return tuple(Entry(key=k, shape=s) for k, s in sorted(strategy.expected_upload(level).items()))
        rank, top = strategy.rank_of(strategy.params, level), strategy.params.max_rank
        scale = strategy.scale_of(rank)
        entries = [Entry(key=k, shape=tuple(strategy.state[k].shape)) for k in strategy.head_keys]
        for name, (out_features, in_features) in sorted(strategy.layers.items()):
            reduce, expand = f"{name}.reduce", f"{name}.expand"
            if isinstance(strategy, FedLoRA):
                entries.append(
                    Entry(key=f"{name}.delta", shape=(out_features, in_features), factors=(reduce, expand), scale=scale)
                )
                continue
            kept = tuple(range(rank))
            entries.append(Entry(key=reduce, shape=(top, in_features), index=(kept, None)))
            entries.append(Entry(key=expand, shape=(out_features, top), index=(None, kept), scale=scale))
        return tuple(entries)

    def layout(self, device: str) -> Layout:
        return Layout(entries=self.entries[device])

    def _reference(self, device: str, entry: Entry) -> tuple[Tensor, Tensor]:
        """What ``device``'s value of ``entry`` is relative to (what it was sent, in the layout's form), and where
        it holds a value (1) or padded one (0)."""
        sent = self.sent[device]
        if entry.factors is not None:
            reduce, expand = entry.factors
            value = reconstruct(sent[reduce].double(), sent[expand].double(), entry.shape) * entry.scale
            return value, torch.ones(entry.shape, dtype=torch.float64)
        value = sent[entry.key].double() * entry.scale
        return place(entry, value), place(entry, torch.ones_like(value))

    def fold(self, aggregate: RoundAggregate, total: np.ndarray, survivors: Sequence[str]) -> None:
        if not isinstance(aggregate, FineTuneRound):
            raise TypeError(f"{type(aggregate).__name__} is not a fine-tuning round")
        weight, n = sum(self.weights[d] for d in survivors), len(survivors)
        sums = {}
        for index, (key, part) in enumerate(zip(self.keys, _split(total, self.shapes), strict=True)):
            sent, held = torch.zeros(part.shape, dtype=torch.float64), torch.zeros(part.shape, dtype=torch.float64)
            for device in survivors:
                value, holds = self._reference(device, self.entries[device][index])
                sent, held = sent + self.weights[device] * value, held + holds
            sums[key] = sent + part - (n - held) * self.zero
        if isinstance(aggregate, FactorRound):  # one full-rank "device" carrying the zero-padded average
            for name in aggregate.factors:
                expand, reduce = sums.pop(f"{name}.expand") / weight, sums.pop(f"{name}.reduce") / weight
                aggregate.factors[name] = [ClientFactors(expand, reduce, 1.0)]
        aggregate.sums, aggregate.total, aggregate.shift = sums, weight, self.top


class PrivateLayout(FlatLayout):
    """DP-FedAvg under SecAgg: each of the n participants adds N(0, (z C)^2 / n) to its clipped update, unweighted.

    The sum of the m survivors then carries noise of std z C sqrt(m / n): the target z C when nobody dropped, less
    when some did, and the privacy ledger charges what it was (:meth:`PrivateStrategy.charge`).
    """

    def __init__(self, strategy: PrivateStrategy, sent: Mapping[str, Tensor], slots: Sequence[ClientSlot]) -> None:
        super().__init__(sent, slots, weighted=False)
        self.participants = len(slots)
        self.noise = strategy.update_noise * strategy.clip_norm / math.sqrt(self.participants)

    def fold(self, aggregate: RoundAggregate, total: np.ndarray, survivors: Sequence[str]) -> None:
        if not isinstance(aggregate, PrivateRound):
            raise TypeError(f"{type(aggregate).__name__} is not a private round")
        for key, part in zip(self.keys, _split(total, [tuple(self.sent[k].shape) for k in self.keys]), strict=True):
            contributions = self.sent[key].to(torch.float64) * len(survivors) + part  # sum of sent + noised update
            aggregate.sums[key] = aggregate.sums.get(key, 0) + contributions
        aggregate.distributed = (len(survivors), self.participants)


def _sums_and_counts(aggregate: RoundAggregate) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    sums, counts = getattr(aggregate, "sums", None), getattr(aggregate, "counts", None)
    if sums is None or counts is None:
        raise TypeError(f"{type(aggregate).__name__} does not take a secure sum of one model's updates")
    return sums, counts


def secure_layout(
    strategy: Strategy,
    round_: int,
    slots: Sequence[ClientSlot],
    assignments: Mapping[str, Mapping[str, Tensor]],
    settings: SecureAggregation,
) -> SecureLayout:
    """The layout of ``strategy``'s round; ``TypeError`` for a strategy that does not run under secure aggregation."""
    if isinstance(strategy, PrivateStrategy) and isinstance(strategy.inner, FedAvg):
        return PrivateLayout(strategy, assignments[slots[0].client_id], slots)
    if isinstance(strategy, (FedAvg, FedAvgSmall)):  # one model for every device (FedAvgSmall's is narrow)
        return FlatLayout(assignments[slots[0].client_id], slots)
    if isinstance(strategy, HeteroFL):
        return SliceLayout(strategy, round_, slots, settings)
    if isinstance(strategy, FedHM):
        if strategy.params.label_masked_classifier is not ClassifierRule.OFF or strategy.params.global_as_pseudo_client:
            raise TypeError("fedhm runs under secure aggregation without label masking and the pseudo client")
        return DenseLayout(strategy, assignments, slots)
    if isinstance(strategy, HetLoRA) and strategy.params.weighting != "samples":
        raise TypeError("hetlora runs under secure aggregation with weighting: samples (sparsity reads each device)")
    if isinstance(strategy, FineTune) and (not isinstance(strategy, RankedLoRA) or isinstance(strategy, HetLoRA)):
        return FineTuneLayout(strategy, slots, assignments, settings)
    raise TypeError(f"{strategy.name} does not run under secure aggregation")


__all__ = [
    "DenseLayout",
    "FineTuneLayout",
    "FlatLayout",
    "PrivateLayout",
    "SecureLayout",
    "SliceLayout",
    "secure_layout",
]
