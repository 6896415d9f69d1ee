"""The schema of one line of ``metrics.jsonl``: what a closed round did, device by device.

Validated on write and on read, so a report never plots a typo and a hand-edited or truncated file
is named with its line instead of failing deep inside matplotlib.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

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
    local_accuracy: Fraction | None = Field(
        None, description="the device's trained model on its own test shard, as it reported (accepted updates)"
    )


class RoundMetrics(BaseModel):
    """One closed round. ``phases`` splits ``seconds`` (e.g. plan, push, train, aggregate, evaluate, checkpoint).

    ``accuracy`` is the strategy's global model on the coordinator's test split. For a personalized
    strategy (Factorized-FL) that model is only a reference, since every device trains its own; its
    measure is ``personalized_accuracy``, the mean of the accepted devices' ``local_accuracy``.
    """

    model_config = ConfigDict(extra="forbid")

    round: Annotated[int, Field(ge=1)]
    accuracy: Fraction
    loss: NonNegative
    personalized_accuracy: Fraction | None = None
    participants: Annotated[int, Field(ge=0)]
    bytes_up: Bytes
    bytes_down: Bytes
    seconds: NonNegative
    phases: dict[str, NonNegative] = Field(default_factory=dict)
    devices: dict[str, DeviceRoundMetrics] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self) -> RoundMetrics:
        accepted = sum(device.status == "accepted" for device in self.devices.values())
        if self.devices and accepted != self.participants:
            raise ValueError(f"participants is {self.participants} but {accepted} device(s) have status 'accepted'")
        reported = [d.local_accuracy for d in self.devices.values() if d.local_accuracy is not None]
        if self.personalized_accuracy is not None and not reported:
            raise ValueError("personalized_accuracy is set but no device reported a local_accuracy")
        if math.fsum(self.phases.values()) > self.seconds * 1.01 + 1e-3:
            raise ValueError(f"phases add up to more than the round's {self.seconds} seconds")
        return self
