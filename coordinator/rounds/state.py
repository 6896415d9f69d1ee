"""What the round core knows between events: each device, each participant of the open round, refusals."""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from coordinator.algorithms.aggregation import UpdateRejected
from coordinator.config.fleet import Device
from coordinator.strategies import RoundAggregate
from device_agent.common.profile import DeviceProfile
from device_agent.wire.codec import CodecError
from device_agent.wire.protocol import ReceivedEvaluation, UploadMetaError

RECENT_REFUSALS = 50


def refusal_reason(exc: Exception) -> str:
    """A bounded label for why an upload was refused: the error's ``reason`` code or its kind."""
    reason = getattr(exc, "reason", None)
    if isinstance(reason, str) and reason:
        return reason
    return {UpdateRejected: "rejected", UploadMetaError: "bad_meta", CodecError: "bad_payload"}.get(type(exc), "other")


def printable(text: str, limit: int = 200) -> str:
    """A device-chosen string fit for one log line: no control characters, bounded length."""
    clean = "".join(c if c.isprintable() else "?" for c in text[:limit])
    return clean + ("..." if len(text) > limit else "")


@dataclass(frozen=True)
class Refusal:
    """One refused upload, kept for the status page (the last ``RECENT_REFUSALS``)."""

    device: str
    round: int
    reason: str
    detail: str
    time: float


class Refusals:
    """Refused messages and uploads, for metrics exporters and the status page.

    Reasons are short snake_case codes, so the (device, reason) label set stays bounded.
    """

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()
        self.recent: deque[Refusal] = deque(maxlen=RECENT_REFUSALS)

    def count(self, device: str, reason: str) -> None:
        self.counts[(device, reason)] += 1

    def upload(self, device: str, round_: int, reason: str, detail: str) -> None:
        self.count(device, reason)
        self.recent.append(Refusal(device, round_, reason, detail[:300], time.time()))


@dataclass
class DeviceState:
    """What the coordinator knows about one fleet device right now."""

    device: Device
    online: bool = False
    state: str = "unknown"
    profile: DeviceProfile | None = None
    agent_version: str | None = None
    refused: str | None = None
    """Why the coordinator will not work with this device (another protocol version), until it says hello."""


@dataclass
class Participant:
    """One device's part in the open round."""

    level: float
    trained_level: float | None = None
    """The level the device actually trains (a fixed-width strategy may differ from the plan)."""
    status: str = "assigned"
    bytes_up_start: int = 0
    bytes_down_start: int = 0
    payload_bytes: int = 0
    train_seconds: float | None = None
    host_seconds: float | None = None
    error: str | None = None
    reason: str | None = None
    """A short code for why it was rejected or failed (``error`` holds the detail)."""
    local_accuracy: float | None = None
    clipped: float | None = None
    """Its accepted update was clipped to the bound: the smallest share of a layer's update kept."""
    rejected_at: float = math.inf
    retried: bool = False
    """Its assignment was sent again after a refusal (once per round: a device that keeps failing is not retrained)."""
    received: ReceivedEvaluation | None = None
    assigned_at: float | None = None
    """When its assignment was last sent (``time.monotonic()``): a re-sent one restarts its laggard clock."""
    answered_at: float | None = None
    """When its update was first seen accepted (``time.monotonic()``): the round's answer times."""

    def reject(self, reason: str, why: str) -> None:
        """Refused, but not an answer yet: the device may still send a valid update (see OpenRound.answered)."""
        self.status, self.reason, self.error, self.rejected_at = "rejected", reason, why, time.monotonic()


@dataclass
class OpenRound:
    round: int
    participants: dict[str, Participant]
    aggregate: RoundAggregate
    deadline: float
    started: float
    extended: bool = False
    retries: int = 0
    """Times it was retried below its quorum (``on_quorum_miss: retry``)."""
    phases: dict[str, float] = field(default_factory=dict)
    pushed: float = math.inf
    """When its assignments had all left (``time.monotonic()``): answer times count from here."""

    def answered(self, devices: dict[str, DeviceState], rejected_before: float = math.inf) -> bool:
        """Every participant accepted, failed, offline, or refused at or before ``rejected_before`` (monotonic).

        A fresh refusal is no answer yet: the device may still send a valid update, which must not be late.
        """
        return all(
            p.status in ("accepted", "failed")
            or (p.status == "rejected" and p.rejected_at <= rejected_before)
            or not devices[d].online
            for d, p in self.participants.items()
        )

    @property
    def accepted(self) -> list[str]:
        return [d for d, p in self.participants.items() if p.status == "accepted"]


__all__ = [
    "RECENT_REFUSALS",
    "DeviceState",
    "OpenRound",
    "Participant",
    "Refusal",
    "Refusals",
    "printable",
    "refusal_reason",
]
