"""How the round engine waits and what it accepts: fleet.yaml's ``limits`` and the run's device count."""

from __future__ import annotations

from dataclasses import dataclass, field

from coordinator.config.fleet import Fleet
from coordinator.config.limits import FleetLimits, GateSettings

_FLEET_DEFAULTS = FleetLimits()
"""fleet.yaml's ``limits`` left out: an engine built without a fleet waits on assignments the same way."""


@dataclass(frozen=True)
class EngineSettings:
    min_devices: int
    wait_timeout_s: float = 600.0
    calibration_samples: int = 1024
    gate: GateSettings = field(default_factory=GateSettings)
    resend_after_s: float = _FLEET_DEFAULTS.resend_after_s
    """An assignment is sent again to a participant that says it is idle at least this long after the last one."""
    rejected_grace_s: float = _FLEET_DEFAULTS.rejected_grace_s
    """How long a refused participant may still send a valid update before the round stops waiting for it."""
    laggard_grace_factor: float = _FLEET_DEFAULTS.laggard_grace_factor
    """A round with its quorum waits for the rest at most this many times its accepted updates' median time."""
    laggard_grace_min_s: float = _FLEET_DEFAULTS.laggard_grace_min_s
    """... and at least this long (from the push)."""
    settle_s: float = 2.0
    """Once ``min_devices`` are online, how long the first round still waits for the rest of the fleet: devices
    started together connect moments apart, and the one 44 ms after the quorum would miss round 1."""

    @classmethod
    def of(cls, fleet: Fleet, min_devices: int, wait_timeout_s: float) -> EngineSettings:
        """A run's settings with what fleet.yaml's ``limits`` says of updates and assignments."""
        limits = fleet.limits
        return cls(
            min_devices,
            wait_timeout_s,
            gate=limits.gate(),
            resend_after_s=limits.resend_after_s,
            rejected_grace_s=limits.rejected_grace_s,
            laggard_grace_factor=limits.laggard_grace_factor,
            laggard_grace_min_s=limits.laggard_grace_min_s,
        )


__all__ = ["EngineSettings"]
