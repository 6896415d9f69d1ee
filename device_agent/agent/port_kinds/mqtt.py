"""``mqtt``, the default port kind: the device's MQTT session on agent.yaml's ``broker:``."""

from __future__ import annotations

from device_agent.agent.config import AgentConfig
from device_agent.agent.lock import device_key
from device_agent.agent.port import CoordinatorPort, MqttPort
from device_agent.agent.ports import PORTS, PortKind
from device_agent.wire.reachability import wait_for_broker
from device_agent.wire.session import BrokerAddress, ChunkHook


class Mqtt(PortKind):
    def port(
        self, config: AgentConfig, before_chunk_out: ChunkHook | None = None, after_chunk_in: ChunkHook | None = None
    ) -> CoordinatorPort:
        return MqttPort(config, before_chunk_out, after_chunk_in)

    def preflight(self, config: AgentConfig, give_up_s: float) -> None:
        """Wait for the broker's TCP port: the agent may start before the broker (a boot, a kit run beside it)."""
        broker = BrokerAddress.from_url(config.broker.url)
        wait_for_broker(broker.host, broker.port, give_up_s)

    def claim_key(self, config: AgentConfig) -> str:
        """One login on one broker: a second agent with it would take over the first's session."""
        broker = BrokerAddress.from_url(config.broker.url)
        return device_key(broker.host, broker.port, config.fleet, config.device)


PORTS.register("mqtt", Mqtt())
