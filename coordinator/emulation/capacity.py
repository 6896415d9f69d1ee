"""Whether this host can train an emulated fleet's round within its deadline: said before round 1.

An emulated device trains for real on the host; only the pacing (sleeping to its profile's step time)
is free. So a round needs at least the host time of every device's training, spread over the host's
cores. A device's step costs on this host what the cost model predicts on its profile, scaled by its
profile's fp32 GFLOPS over the host's per-core GFLOPS (the same ratio ``--pace host-ratio`` uses);
its steps per round are its samples (``samples_per_device``, its ``overrides.samples``, else the training
set split over the fleet) over its batch, times the local epochs. Evaluation, encoding and the transport
come on top, so the figure is a lower bound. A fleet beyond it would close rounds at the deadline with few
or no updates; the operator is told so before the run, with what to change.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from coordinator.config.fleet import Fleet
from coordinator.emulation.emulator import predicted_step_seconds
from coordinator.planning.planner import effective_profile
from profiles.schema import DeviceClass


@dataclass(frozen=True)
class HostLoad:
    """Core-seconds of training one round asks of the host, every device at the smallest and the full level."""

    devices: int
    cores: int
    smallest_level: float
    seconds_smallest: float
    seconds_full: float
    deadline_s: float

    @property
    def floor_s(self) -> float:
        """The shortest a round can be here: the smallest levels' training, spread over every core."""
        return self.seconds_smallest / self.cores

    @property
    def full_s(self) -> float:
        return self.seconds_full / self.cores

    def warning(self) -> str | None:
        """What to tell the operator, or None when the host can carry the fleet at full size."""
        if self.full_s <= self.deadline_s:
            return None
        need = (
            f"training alone needs about {self.full_s:.0f} s of this host's {self.cores} core(s) per round with "
            f"every device at full size ({self.floor_s:.0f} s at level {self.smallest_level:g})"
        )
        if self.floor_s > self.deadline_s:
            return (
                f"this host is over capacity for {self.devices} emulated devices: {need}, over round_deadline_s "
                f"{self.deadline_s:g} s. Rounds will close at the deadline with the updates that arrived, maybe none: "
                "emulate fewer devices, raise round_deadline_s, or spread the fleet over several hosts "
                "(device-agent emulate)"
            )
        return (
            f"this host may not train every device of {self.devices} in time: {need}; round_deadline_s is "
            f"{self.deadline_s:g} s, so devices planned at large levels may miss it"
        )


def host_load(fleet: Fleet, catalog: Mapping[str, DeviceClass], gflops_per_core: float, cores: int) -> HostLoad:
    """The fleet's training per round on a host of ``cores`` cores of ``gflops_per_core`` fp32 GFLOPS each."""
    if gflops_per_core <= 0 or cores < 1:
        raise ValueError(f"host: expected positive GFLOPS and cores, got {gflops_per_core} and {cores}")
    smallest = min(fleet.ratios)
    totals = {smallest: 0.0, 1.0: 0.0}
    for device in fleet.devices:
        profile = effective_profile(device, catalog[device.profile], None)
        assert profile is not None  # emulated devices have static profiles (checked by device_limits)
        train = fleet.training.for_device(device, seed=0)
        steps = math.ceil(fleet.samples_for(device) / train.batch_size) * train.epochs
        speedup = profile.compute.fp32_gflops / gflops_per_core
        step = predicted_step_seconds(fleet, device, profile)
        for level in totals:
            totals[level] += steps * step[level] * speedup
    return HostLoad(len(fleet.devices), cores, smallest, totals[smallest], totals[1.0], fleet.round_deadline_s)


__all__ = ["HostLoad", "host_load"]
