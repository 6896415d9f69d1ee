"""FedBuff (Nguyen et al., 2022): buffered asynchronous aggregation over any strategy with one dense update space.

There are no rounds. A device is sent the newest published model (its *version*), trains, and uploads what it
trained; the upload names the version it started from. The server turns the upload into a dense update in the
global model's space, exactly as a one-device round of the strategy would fold it (FedHM: each factorized layer
rebuilt from its factors, ``A @ B``, at the device's own rank), minus the version it trained on. The update joins
a buffer weighted by its staleness ``s`` (versions published since it started): w(s) = 1 / sqrt(1 + s) by default.
Every ``K`` updates the buffer's mean moves the global model by the server learning rate and a new version is
published (FedHM: the next assignments factorize it again, one decomposition per version and level).

Bounds: an update more than ``max_staleness`` versions old is refused (``too_stale``, with the numbers), as is
one from a device that holds no assignment of that version; at most ``concurrency`` devices train at once.
The past versions an update may still be folded against (``max_staleness`` of them) are kept.

Pure tensor code over :class:`~coordinator.strategies.base.Strategy`: no transport, clock or files, so the
same object runs in a unit test, in the fleet-clock emulation and behind the engine. ``check`` changes nothing
and ``fold`` folds what ``check`` accepted: the caller journals the update between the two.
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from coordinator.algorithms.aggregation import UpdateRejected, log_score
from coordinator.config.asynchronous import AsyncSettings
from coordinator.strategies.base import Assignment, ClientSlot, Strategy
from device_agent.clients.base import is_norm_statistic

GLOBAL = "global."
"""Where the strategies that run async (FedAvg, FedHM) keep the global model in their state dict."""


class TooStale(UpdateRejected):
    """An update trained on a version older than ``max_staleness`` allows."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "too_stale")


@dataclass(frozen=True)
class Folded:
    """One update folded into the buffer: who, on which version, how stale, with what weight."""

    device: str
    version: int
    staleness: int
    weight: float


@dataclass(frozen=True)
class Published:
    """A new model version: the updates that made it."""

    version: int
    updates: tuple[Folded, ...]


@dataclass
class _Buffer:
    sums: dict[str, Tensor] = field(default_factory=dict)
    """Sum over the buffer of exp(score - reference) * staleness weight * update."""
    updates: list[Folded] = field(default_factory=list)
    shares: float = 0.0
    """Sum over the buffer of exp(score - reference): the softmax's denominator."""
    reference: float | None = None
    """The first update's score: every exponent is taken relative to it (no overflow for any temperature)."""


class FedBuff:
    """The server side of FedBuff over ``strategy`` (its state is the newest published version).

    ``version`` starts at 0 (the strategy's model as it is); ``assign`` records which version a device holds,
    ``check`` / ``fold`` take its update back. Observers read ``version``, ``updates_per_version`` and
    ``staleness_histogram``.
    """

    def __init__(self, strategy: Strategy, settings: AsyncSettings, version: int = 0) -> None:
        self.strategy = strategy
        self.settings = settings
        self.version = version
        self._versions: dict[int, dict[str, Tensor]] = {version: self._state()}
        self._scratch = copy.deepcopy(strategy)  # rebuilds one device's upload as a one-device round would
        self._assignments: dict[float, Assignment] = {}
        """Level -> the newest version's assignment at that level."""
        self.in_flight: dict[str, int] = {}
        """Device -> the version it was sent and has not answered yet."""
        self._buffer = _Buffer()
        self.updates_per_version: dict[int, int] = {}
        """Published version -> how many updates made it."""
        self.staleness_histogram: Counter[int] = Counter()
        """Staleness -> folded updates (refused ones are the caller's to count)."""

    @property
    def buffered(self) -> int:
        """Updates folded since the last published version."""
        return len(self._buffer.updates)

    def can_assign(self) -> bool:
        """Fewer than ``concurrency`` devices are training."""
        limit = self.settings.concurrency
        return limit is None or len(self.in_flight) < limit

    def assign(self, slot: ClientSlot) -> tuple[int, Assignment]:
        """The newest version for ``slot``'s device: (version, what it trains). One configure per version and level.

        A device given a new assignment gives up its old one (its update of the old version will be refused).
        """
        if slot.client_id not in self.in_flight and not self.can_assign():
            raise RuntimeError(f"{self.settings.concurrency} devices already train (async.concurrency)")
        if slot.level not in self._assignments:  # what a level receives depends on the version, not the device
            self._assignments[slot.level] = self.strategy.configure(self.version, [slot])[slot.client_id]
        self.in_flight[slot.client_id] = self.version
        return self.version, self._assignments[slot.level]

    def release(self, device: str) -> None:
        """The device gave its assignment up (it went offline, or failed it): its slot is free."""
        self.in_flight.pop(device, None)

    def staleness(self, device: str, version: int) -> int:
        """How many versions were published since ``version``; refuses an update nobody assigned or too old."""
        held = self.in_flight.get(device)
        if held != version:
            holds = "no assignment" if held is None else f"version {held}"
            raise UpdateRejected(f"{device!r} uploaded for version {version} but holds {holds}", "wrong_round")
        stale = self.version - version
        if stale > self.settings.max_staleness or version not in self._versions:
            raise TooStale(
                f"{device!r} trained on version {version}, {stale} versions behind the newest ({self.version}); "
                f"async.max_staleness is {self.settings.max_staleness}"
            )
        return stale

    def check(
        self,
        slot: ClientSlot,
        version: int,
        tensors: Mapping[str, Tensor],
        num_samples: int,
        extras: Mapping[str, Tensor] | None = None,
    ) -> int:
        """The update's staleness, or ``UpdateRejected`` (``TooStale``) saying why it is refused; changes nothing."""
        stale = self.staleness(slot.client_id, version)
        aggregate = self.strategy.open_round(version, [slot])
        self.strategy.upload_contract(slot).check(tensors, extras)  # names, shapes, dtypes, finite and bounded
        aggregate.check(slot.client_id, dict(tensors), num_samples, _dict(extras))
        return stale

    def fold(
        self,
        slot: ClientSlot,
        version: int,
        tensors: Mapping[str, Tensor],
        num_samples: int,
        extras: Mapping[str, Tensor] | None = None,
    ) -> Published | None:
        """Fold an update :meth:`check` accepted; the new version when this one filled the buffer."""
        stale = self.staleness(slot.client_id, version)
        base = self._versions[version]
        rebuilt = self._rebuild(slot, version, base, tensors, num_samples, extras)
        weight = self.settings.staleness_weight(stale)
        score = self.score(slot, num_samples)
        buffer = self._buffer
        if buffer.reference is None:
            buffer.reference = score
        elif score > buffer.reference:  # keep every exponent <= 0: rescale what is summed so far
            rescale = math.exp(buffer.reference - score)
            for total in buffer.sums.values():
                total.mul_(rescale)
            buffer.shares *= rescale
            buffer.reference = score
        share = math.exp(score - buffer.reference)
        buffer.shares += share
        for key, value in rebuilt.items():
            delta = value.to(torch.float64) - base[key].to(torch.float64)
            if key in buffer.sums:
                buffer.sums[key].add_(delta, alpha=share * weight)
            else:
                buffer.sums[key] = delta.mul_(share * weight)
        del self.in_flight[slot.client_id]
        folded = Folded(slot.client_id, version, stale, weight)
        self._buffer.updates.append(folded)
        self.staleness_histogram[stale] += 1
        if len(self._buffer.updates) < self.settings.buffer:
            return None
        return self._publish()

    def _rebuild(
        self,
        slot: ClientSlot,
        version: int,
        base: Mapping[str, Tensor],
        tensors: Mapping[str, Tensor],
        num_samples: int,
        extras: Mapping[str, Tensor] | None,
    ) -> dict[str, Tensor]:
        """The dense global-space model a one-device round from ``base`` ends at: trainable entries only."""
        scratch = self._scratch
        scratch.load_state_dict({f"{GLOBAL}{k}": v for k, v in base.items()})
        aggregate = scratch.open_round(version, [slot])
        aggregate.fold(slot.client_id, dict(tensors), num_samples, _dict(extras))
        scratch.close_round(aggregate)
        return {k: v for k, v in scratch.global_state().items() if _trained(k, v)}

    def score(self, slot: ClientSlot, num_samples: int) -> float:
        """The update's log-weight among the buffer's: the strategy's level weighting where it has one (FedHM's
        ``weighting``: softmax(gamma / tau) by default, as a sync round weights levels), else 0 (FedAvg: uniform,
        FedBuff's own rule)."""
        weighting = getattr(self.strategy.params, "weighting", None)
        if weighting is None:
            return 0.0
        temperature = float(getattr(self.strategy.params, "temperature", 1.0))
        return log_score(weighting, slot.level, max(1, num_samples), temperature)

    def _publish(self) -> Published:
        """global += server_lr * sum_i softmax_i(score) * w(s_i) * update_i (uniform scores: the buffer's mean of
        staleness-weighted updates, FedBuff's rule); the new version is the strategy's state."""
        step = self.settings.server_lr / self._buffer.shares
        current = self._state()
        for key, total in self._buffer.sums.items():
            current[key] = (current[key].to(torch.float64) + step * total).to(current[key].dtype)
        self.strategy.load_state_dict({f"{GLOBAL}{k}": v for k, v in current.items()})
        made = Published(self.version + 1, tuple(self._buffer.updates))
        self.version = made.version
        self._buffer = _Buffer()
        self.updates_per_version[made.version] = len(made.updates)
        self.remember()
        return made

    def base(self, version: int) -> dict[str, Tensor]:
        """The global model entries of a version updates may still be folded against."""
        return dict(self._versions[version])

    def restore(self, bases: Mapping[int, Mapping[str, Tensor]]) -> None:
        """A resumed server: the past versions (global model entries) updates may still be folded against."""
        self._versions.update({v: dict(state) for v, state in bases.items() if v < self.version})
        self.remember()

    def remember(self) -> None:
        """Keep the strategy's current model as the newest version's base (call after changing it in place, e.g.
        static BN), and forget versions no update may be folded against any more."""
        self._versions[self.version] = self._state()
        for old in [v for v in self._versions if v < self.version - self.settings.max_staleness]:
            del self._versions[old]
        self._assignments.clear()

    def _state(self) -> dict[str, Tensor]:
        state = self.strategy.state_dict()
        found = {k.removeprefix(GLOBAL): v.detach().clone() for k, v in state.items() if k.startswith(GLOBAL)}
        if len(found) != len(state):
            raise TypeError(f"{self.strategy.name} keeps more than a global model; it cannot run async")
        return found


def _trained(key: str, value: Tensor) -> bool:
    return value.is_floating_point() and not is_norm_statistic(key)


def _dict(extras: Mapping[str, Tensor] | None) -> dict[str, Tensor] | None:
    return None if extras is None else dict(extras)


__all__ = ["FedBuff", "Folded", "Published", "TooStale"]
