"""Port kinds by name: how ``device-agent run`` reaches its coordinator is a plugin, like a strategy.

agent.yaml's ``transport.kind`` names a :class:`PortKind` in :data:`PORTS`. The built-in ones are in
:mod:`device_agent.agent.port_kinds` (``mqtt``, the default: the device's MQTT session on ``broker:``);
another installed package adds one under the entry point group ``fedfleet.ports`` (a module that calls
``PORTS.register(name, kind)``), with no edit of fedfleet itself. It is the device's half of a transport:
the coordinator's half registers under ``fedfleet.transports`` (the agent never imports the coordinator).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from device_agent.agent.config import AgentConfig, ConfigError
from device_agent.agent.port import CoordinatorPort
from device_agent.common.registry import Registry
from device_agent.wire.session import ChunkHook

ENTRY_POINT_GROUP = "fedfleet.ports"


@dataclass(frozen=True)
class Finding:
    """One line of ``device-agent doctor`` about the way to the coordinator: ``ok`` None is a skipped check."""

    name: str
    ok: bool | None
    detail: str
    hint: str = ""


class PortKind(ABC):
    """One way for an agent to reach its coordinator: it makes the port, and may check the way is open first."""

    @abstractmethod
    def port(
        self, config: AgentConfig, before_chunk_out: ChunkHook | None = None, after_chunk_in: ChunkHook | None = None
    ) -> CoordinatorPort:
        """The agent's port; the hooks (an emulated device's link shaping) run around every chunk sent or received."""

    def problems(self, config: AgentConfig) -> list[str]:
        """One line per setting of agent.yaml's ``transport:`` this kind cannot use, each starting with its key.

        A kind's own settings are the section's keys besides ``kind``; by default it takes none.
        """
        return [
            f"transport.{key}: not a setting of port kind {config.transport.kind!r}"
            for key in sorted(config.transport.model_extra or {})
        ]

    def preflight(self, config: AgentConfig, give_up_s: float) -> None:
        """Return once the coordinator's side can be reached (``device-agent run`` waits here before connecting);
        raise ``ConnectionError`` naming the cause after ``give_up_s`` s. Nothing to wait for by default."""
        return None

    def doctor(self, config: AgentConfig, timeout: float) -> list[Finding] | None:
        """``device-agent doctor``'s checks of the way to the coordinator (secrets, address, TLS, login), in the
        order they depend on each other; None when this kind has none (doctor says it skipped them)."""
        return None

    def claim_key(self, config: AgentConfig) -> str:
        """What two agents on one machine must not share (``device_agent.agent.lock``): by default the device's
        login in its fleet on this kind of transport."""
        return f"{config.transport.kind}:{config.fleet}/{config.device}"


PORTS: Registry[PortKind] = Registry("port kind", "device_agent.agent.port_kinds", ENTRY_POINT_GROUP)


def port_kind_of(config: AgentConfig) -> PortKind:
    """The kind ``config.transport.kind`` names, its settings checked; a ``ConfigError`` names an unknown kind
    (listing those registered) or each setting the kind refuses."""
    name = config.transport.kind
    if name not in PORTS:
        raise ConfigError(
            f"transport.kind: {name!r} is not a registered port kind (registered: {', '.join(PORTS)}); "
            f"a package adds one under the entry point group {ENTRY_POINT_GROUP!r}"
        )
    kind = PORTS[name]
    problems = kind.problems(config)
    if problems:
        raise ConfigError("; ".join(problems))
    return kind


__all__ = ["ENTRY_POINT_GROUP", "PORTS", "Finding", "PortKind", "port_kind_of"]
