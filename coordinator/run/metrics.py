"""The schema of one line of ``metrics.jsonl``: what a closed round did, device by device.

Validated on write and on read, so a report never plots a typo and a hand-edited or truncated file
is named with its line instead of failing deep inside matplotlib.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from device_agent.wire.protocol import ReceivedEvaluation

NonNegative = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Fraction = Annotated[float, Field(ge=0, le=1)]
Bytes = Annotated[int, Field(ge=0)]

DeviceStatus = Literal["accepted", "rejected", "late", "failed", "dropped"]
"""accepted: folded into the aggregate; rejected: failed validation; late: missed the deadline;
failed: the agent reported an error (out of memory, ...); dropped: went offline mid-round."""


class DeviceRoundMetrics(BaseModel):
    """One selected device in one round. ``bytes_up / payload_bytes`` is the protocol overhead."""

    model_config = ConfigDict(extra="forbid")

    device_class: str = Field(min_length=1)
    ratio: Annotated[float, Field(gt=0, le=1)]
    bytes_up: Bytes
    bytes_down: Bytes
    payload_bytes: Bytes = Field(description="the factor payload itself (safetensors), without protocol overhead")
    train_seconds: NonNegative | None = Field(
        None, description="local training as the device spends it (an emulated device: held to its profile's pace)"
    )
    host_seconds: NonNegative | None = Field(
        None, description="an emulated device only: the part of train_seconds the host computed (it slept the rest)"
    )
    status: DeviceStatus
    error: str | None = None
    reason: str | None = Field(
        None,
        max_length=64,
        description="why a device was rejected or failed, as a short code (e.g. wrong_direction); error has the detail",
    )
    local_accuracy: Fraction | None = Field(
        None, description="the device's trained model on its own test shard, as it reported (accepted updates)"
    )
    clipped: Fraction | None = Field(
        None,
        description="its accepted update was clipped to the update bound: the smallest share of a layer's "
        "update kept (None: not clipped)",
    )
    global_accuracy: Fraction | None = Field(
        None, description="federated evaluation: the model the device received, on its own test shard, before training"
    )
    global_loss: NonNegative | None = Field(None, description="cross-entropy of that same evaluation")
    eval_samples: Annotated[int, Field(ge=1)] | None = Field(
        None, description="test samples behind global_accuracy and global_loss"
    )


class PrivacyMetrics(BaseModel):
    """The run's user-level privacy after this round (fleet.yaml ``privacy``; docs/privacy.md)."""

    model_config = ConfigDict(extra="forbid")

    epsilon: NonNegative = Field(description="epsilon at delta after this round, from dp-accounting's RDP accountant")
    delta: Annotated[float, Field(gt=0, lt=1)]
    clip_norm: Annotated[float, Field(gt=0, allow_inf_nan=False)] = Field(
        description="the clip norm for the next round (adaptive clipping moves it)"
    )
    noise_multiplier: Annotated[float, Field(gt=0, allow_inf_nan=False)]
    unclipped_fraction: float | None = Field(
        None, description="adaptive clipping: the noised fraction of devices whose update was within the clip norm"
    )


class SecureMetrics(BaseModel):
    """A round under secure aggregation (fleet.yaml ``secure_aggregation``; docs/secure-aggregation.md)."""

    model_config = ConfigDict(extra="forbid")

    survivors: Annotated[int, Field(ge=0)] = Field(description="devices whose masked input is in the sum")
    dropped: Annotated[int, Field(ge=0)] = Field(description="devices that left the protocol after its key exchange")
    error_bound: NonNegative = Field(description="the sum's largest quantization error per value")
    clamped_fraction: Fraction = Field(
        description="the survivors' mean fraction of update values clamped to [-clip, clip] before masking "
        "(summed under the masks: no device's own); above 0 the sum is biased, raise secure_aggregation.clip"
    )


class AsyncMetrics(BaseModel):
    """A model version published in async mode (fleet.yaml ``strategy.mode: async``; docs/async.md): in a run's
    metrics each "round" is a version, made of the ``updates`` the buffer folded."""

    model_config = ConfigDict(extra="forbid")

    updates: Annotated[int, Field(ge=1)] = Field(description="updates folded into this version (the buffer, K)")
    staleness: dict[Annotated[int, Field(ge=0)], Annotated[int, Field(ge=1)]] = Field(
        description="staleness (versions published while the update trained) -> this version's updates"
    )
    too_stale: Annotated[int, Field(ge=0)] = Field(
        0, description="updates refused as too stale (async.max_staleness) since the version before"
    )
    in_flight: Annotated[int, Field(ge=0)] = Field(0, description="devices training when this version was published")

    @model_validator(mode="after")
    def _counted(self) -> AsyncMetrics:
        if sum(self.staleness.values()) != self.updates:
            raise ValueError(f"the staleness histogram counts {sum(self.staleness.values())} of {self.updates} updates")
        return self


class RoundMetrics(BaseModel):
    """One closed round. ``phases`` splits ``seconds`` (e.g. plan, push, train, aggregate, evaluate, checkpoint).

    ``accuracy`` is the strategy's global model on the coordinator's test split; None when the
    coordinator does not evaluate (fleet.yaml ``evaluation.server: false``, a coordinator with no data).
    ``federated_accuracy`` is the devices' federated evaluation, weighted by their test samples: the
    model they received this round, i.e. the global model after the round before. For a personalized
    strategy (Factorized-FL) that model is only a reference, since every device trains its own; its
    measure is ``personalized_accuracy``, the mean of the accepted devices' ``local_accuracy``.
    """

    model_config = ConfigDict(extra="forbid")

    round: Annotated[int, Field(ge=1)]
    accuracy: Fraction | None = None
    loss: NonNegative | None = None
    federated_accuracy: Fraction | None = None
    federated_loss: NonNegative | None = None
    personalized_accuracy: Fraction | None = None
    participants: Annotated[int, Field(ge=0)]
    bytes_up: Bytes
    bytes_down: Bytes
    seconds: NonNegative
    phases: dict[str, NonNegative] = Field(default_factory=dict)
    devices: dict[str, DeviceRoundMetrics] = Field(default_factory=dict)
    privacy: PrivacyMetrics | None = None
    secure: SecureMetrics | None = None
    asynchronous: AsyncMetrics | None = None
    """In async mode (docs/async.md): this "round" is a model version; what made it."""

    @model_validator(mode="after")
    def _consistent(self) -> RoundMetrics:
        accepted = sum(device.status == "accepted" for device in self.devices.values())
        if self.devices and accepted != self.participants:
            raise ValueError(f"participants is {self.participants} but {accepted} device(s) have status 'accepted'")
        reported = [d.local_accuracy for d in self.devices.values() if d.local_accuracy is not None]
        if self.personalized_accuracy is not None and not reported:
            raise ValueError("personalized_accuracy is set but no device reported a local_accuracy")
        if (self.accuracy is None) != (self.loss is None):
            raise ValueError("accuracy and loss are set together (server evaluation) or both left out")
        evaluated = any(d.global_accuracy is not None for d in self.devices.values())
        if self.federated_accuracy is not None and not evaluated:
            raise ValueError("federated_accuracy is set but no device reported a global_accuracy")
        if math.fsum(self.phases.values()) > self.seconds * 1.01 + 1e-3:
            raise ValueError(f"phases add up to more than the round's {self.seconds} seconds")
        return self


def round_scores(rounds: Iterable[RoundMetrics]) -> dict[int, float]:
    """Each round state's accuracy, to pick the best one: the devices' own (personalized), else the server's.

    A round with neither (no server evaluation, devices without test shards) is not scored. Federated
    accuracy is no score here: the devices that report it also report their own accuracy, from the same shards.
    """
    scores = {}
    for row in rounds:
        score = row.personalized_accuracy if row.personalized_accuracy is not None else row.accuracy
        if score is not None:
            scores[row.round] = score
    return scores


def failed_rounds(rounds: Iterable[RoundMetrics], quorum: float) -> list[int]:
    """Rounds that aggregated no update, or fewer than ``quorum`` (fleet.yaml) of the devices they asked.

    Such a round still closes (its global model is the round before's, or barely trained): a run that
    ends with one must say so, not "all rounds done".
    """
    return [row.round for row in rounds if is_failed(row, quorum)]


def is_failed(row: RoundMetrics, quorum: float) -> bool:
    """Whether the round aggregated no update, or fewer than ``quorum`` of the devices it asked."""
    return row.participants == 0 or row.participants < math.ceil(quorum * len(row.devices))


def received_metrics(received: ReceivedEvaluation | None) -> dict[str, float | int | None]:
    """A device's federated evaluation as :class:`DeviceRoundMetrics` fields (all None without one)."""
    if received is None:
        return {"global_accuracy": None, "global_loss": None, "eval_samples": None}
    return {"global_accuracy": received.accuracy, "global_loss": received.loss, "eval_samples": received.samples}
