"""Measured reports as the planner gets them: checked against the device's profile, and steady.

A device reports its measured speed and free memory at every (re)connect. Taken as they come, one
reading from a busy moment excludes a laptop for the run ("round takes ~217 s > deadline"), and
a reading that wobbles around a threshold flips the device's level every reconnect. So:

- a measured speed more than ``TRUSTED_FACTOR`` away from the device's static profile is bounded to
  that factor, and the coordinator says so once (a busy host reads slow; a device really this far
  from its profile needs a matching profile or ``overrides.compute``);
- a new measurement replaces the one in use only when it differs by more than ``CHANGE`` (speed
  and usable memory alike): the plan follows real changes, not noise.
"""

from __future__ import annotations

import logging

from device_agent.common.profile import ComputeSpec, DeviceProfile
from profiles.schema import DeviceClass

log = logging.getLogger("fedfleet.planning")

TRUSTED_FACTOR = 2.0
CHANGE = 0.25


class SteadyReports:
    """The report in use per device; :meth:`adopt` is called with every hello."""

    def __init__(self) -> None:
        self._in_use: dict[str, DeviceProfile] = {}

    def adopt(self, device: str, report: DeviceProfile, profile: DeviceClass | None) -> DeviceProfile:
        """What the planner uses for ``device`` after it reported ``report`` (``profile``: its static one)."""
        previous = self._in_use.get(device)
        gflops = self._trusted_gflops(report.compute.fp32_gflops, profile)
        memory = report.memory
        if previous is not None:
            if _close(gflops, previous.compute.fp32_gflops):
                gflops = previous.compute.fp32_gflops
            if _close(memory.usable_bytes, previous.memory.usable_bytes):
                memory = previous.memory
        compute = ComputeSpec.model_validate({**report.compute.model_dump(), "fp32_gflops": gflops})
        adopted = report.model_copy(update={"matmul_gflops": gflops, "compute": compute, "memory": memory})
        if previous is None or gflops != previous.compute.fp32_gflops:
            self._say(device, report.compute.fp32_gflops, gflops, profile)
        self._in_use[device] = adopted
        return adopted

    @staticmethod
    def _trusted_gflops(measured: float, profile: DeviceClass | None) -> float:
        if profile is None:
            return measured
        expected = profile.compute.fp32_gflops
        return min(max(measured, expected / TRUSTED_FACTOR), expected * TRUSTED_FACTOR)

    @staticmethod
    def _say(device: str, measured: float, used: float, profile: DeviceClass | None) -> None:
        if profile is None:
            log.info("%s: measured %.1f GFLOPS (no static profile); using it", device, measured)
            return
        expected = profile.compute.fp32_gflops
        if used == measured:
            log.info(
                "%s: measured %.1f GFLOPS vs profile %g (%s); using the measurement",
                device,
                measured,
                expected,
                profile.name,
            )
            return
        direction = "below" if measured < used else "above"
        log.warning(
            "%s: measured %.1f GFLOPS vs profile %g (%s); using %.1f: more than %gx %s the profile is more "
            "likely a busy host or a wrong profile than the device (if it is real, set "
            "devices[].overrides.compute.fp32_gflops)",
            device,
            measured,
            expected,
            profile.name,
            used,
            TRUSTED_FACTOR,
            direction,
        )


def _close(new: float, old: float) -> bool:
    return old > 0 and abs(new / old - 1) <= CHANGE
