"""The Link fleet.yaml's ``transport:`` section asks for, so a new transport is one more ``kind`` here.

``mqtt`` (the default) is :class:`~coordinator.transport.link.MqttLink` on the fleet's broker: what
``coordinator start`` runs. ``in_process`` is :class:`~coordinator.transport.memory_link.MemoryLink`: real
agents in this process over memory, their data in memory: what ``simulate()`` builds. Each needs what only
its caller has (a started broker's address, the devices' shards), and a missing one is named.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from coordinator.transport.link import Link, MqttLink
from coordinator.transport.memory_link import LocalDevice, MemoryLink
from device_agent.wire.session import BrokerAddress

if TYPE_CHECKING:
    from coordinator.config.fleet import Fleet


def fleet_link(
    fleet: Fleet,
    broker: BrokerAddress | None = None,
    devices: Sequence[LocalDevice] | None = None,
    **session_config: Any,
) -> Link:
    """The Link of ``fleet.transport.kind``; ``broker`` for mqtt, ``devices`` for in_process."""
    kind = fleet.transport.kind
    if kind == "mqtt":
        if broker is None:
            raise ValueError("transport.kind: mqtt needs a broker to connect to; none was started")
        return MqttLink.of(fleet, broker, **session_config)
    if devices is None:
        raise ValueError(
            "transport.kind: in_process needs the devices' data in this process, which only simulate() has; "
            "use kind: mqtt to reach agents"
        )
    return MemoryLink(devices, fleet.fleet)


__all__ = ["fleet_link"]
