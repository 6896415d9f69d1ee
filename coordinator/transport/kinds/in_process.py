"""``in_process``: real agents on threads of this process over memory, their data in memory (``simulate()``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from coordinator.transport.link import Link
from coordinator.transport.memory_link import LocalDevice, MemoryLink
from coordinator.transport.registry import TRANSPORTS, Transport

if TYPE_CHECKING:
    from coordinator.config.fleet import Fleet


class InProcess(Transport):
    def problems(self, fleet: Fleet, simulation: bool = False) -> list[str]:
        if simulation:
            return self.settings_problems(fleet)
        return [
            f"transport.kind: {fleet.transport.kind} runs the devices inside the coordinator with their data in "
            "memory, which only simulate() sets up; start reaches real agents: use kind: mqtt (the default)"
        ]

    def simulation_link(self, fleet: Fleet, devices: Sequence[LocalDevice], **options: Any) -> Link:
        return MemoryLink(devices, fleet.fleet, **options)


TRANSPORTS.register("in_process", InProcess())
