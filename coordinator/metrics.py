"""The schema of one line of ``metrics.jsonl``: what a closed round did, device by device.

Validated on write and on read, so a report never plots a typo and a hand-edited or truncated file
is named with its line instead of failing deep inside matplotlib.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

NonNegative = Annotated[float, Field(ge=0, allow_inf_nan=False)]
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
    train_seconds: NonNegative | None = None
    status: DeviceStatus
    error: str | None = None


class RoundMetrics(BaseModel):
    """One closed round. ``phases`` splits ``seconds`` (e.g. plan, push, train, aggregate, evaluate, checkpoint)."""

    model_config = ConfigDict(extra="forbid")

    round: Annotated[int, Field(ge=1)]
    accuracy: Annotated[float, Field(ge=0, le=1)]
    loss: NonNegative
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
        if math.fsum(self.phases.values()) > self.seconds * 1.01 + 1e-3:
            raise ValueError(f"phases add up to more than the round's {self.seconds} seconds")
        return self
