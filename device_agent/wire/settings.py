"""A session's settings and counters: what every part of a session reads, so they sit below all of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from device_agent.wire.address import BrokerAddress
from device_agent.wire.engine.manifests import DEFAULT_CHUNK_SIZE, Limits


@dataclass(frozen=True)
class SessionConfig:
    """Connection and transfer settings; the defaults suit a LAN fleet on mosquitto."""

    client_id: str
    broker: BrokerAddress = field(default_factory=BrokerAddress)
    protocol: Literal["5", "3.1.1"] = "5"
    session_expiry_s: int = 3600
    keepalive_s: int = 30
    reconnect_min_s: int = 1
    reconnect_max_s: int = 30
    max_inflight: int = 100
    chunk_size: int = DEFAULT_CHUNK_SIZE
    limits: Limits = field(default_factory=Limits)
    resend_after_s: float = 5.0
    nack_after_s: float = 2.0
    max_attempts: int = 20
    tick_s: float = 0.2
    send_window_bytes: int = 32 * 2**20
    """Most bytes of chunk frames handed to paho and not yet confirmed by the broker (PUBACK); later frames
    wait their turn. Without it a coordinator pushing a model to 1,000 devices built every device's frames at
    once: ~500 MB queued in paho (and in the broker) before the first device had its model."""


@dataclass
class SessionStats:
    rejected: int = 0
    connects: int = 0
    publish_denied: int = 0
    published: int = 0
    # Bytes of every MQTT payload by topic, retransmissions included: the true protocol cost.
    bytes_in: dict[str, int] = field(default_factory=dict)
    bytes_out: dict[str, int] = field(default_factory=dict)
