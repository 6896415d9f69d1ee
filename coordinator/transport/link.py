"""The round engine's port to its devices, addressed by device id.

The engine speaks to a :class:`Link`: control messages and payloads out, messages and verified
payloads in (a :class:`~device_agent.wire.payload.Received` with an opaque digest), byte counters per
device. It never sees topics, client ids, wills, ACL names, manifests or chunks: those belong to
:class:`MqttLink`, the link of a real fleet. ``coordinator.transport.memory_link`` runs real agents in this
process over memory for the simulation and the comparison benchmark, so both run the same round core and
the same device runtime as ``coordinator start``.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

from device_agent.wire.guard import InboundGuard, InboundLimits
from device_agent.wire.messages import Manifest, Message
from device_agent.wire.payload import Received
from device_agent.wire.session import BrokerAddress, Delivery, Session, coordinator_session
from device_agent.wire.topics import DeviceTopics, device_of
from device_agent.wire.transfer import make_manifest

if TYPE_CHECKING:
    from coordinator.config.fleet import Fleet

log = logging.getLogger("fedfleet.link")

MessageHandler = Callable[[str, Message], None]
PayloadHandler = Callable[[str, Received], None]
RefusalHandler = Callable[[str, str], None]
"""Told (device, reason) of every frame the transport refused before the engine saw it (rate, retained, bounds)."""


def _ignore_refusal(_device: str, _reason: str) -> None:
    """The default :data:`RefusalHandler`: the transport still logs each burst of refusals."""


class Outgoing(Protocol):
    """A payload made ready to send (hashed, described) once, for any number of devices: opaque to the engine.

    Over MQTT it is the sealed manifest of a chunked transfer; another transport holds what it needs.
    """


class Link(Protocol):
    """What the engine needs from a transport. Handlers may run on any thread; the engine queues them."""

    def start(
        self, on_message: MessageHandler, on_payload: PayloadHandler, on_refused: RefusalHandler = _ignore_refusal
    ) -> None:
        """Connect; from now on ``on_message(device, message)`` and ``on_payload(device, received)`` fire.

        A :class:`~device_agent.wire.payload.Received` is complete and its bytes matched its digest."""

    def stop(self) -> None: ...

    def send_control(self, device: str, message: Message) -> None: ...

    def prepare(self, payload: bytes, **fields: Any) -> Outgoing:
        """``payload`` described by ``fields`` (``run``, ``round``, ``kind``), ready to send to many devices."""
        ...

    def send_payload(self, device: str, payload: bytes, outgoing: Outgoing) -> str:
        """Start delivering ``payload`` to ``device``; returns the transfer id its assignment names."""
        ...

    def payload_in_flight(self, device: str) -> bool:
        """Whether the last payload sent to ``device`` is still on its way (neither acked nor failed)."""
        ...

    def delivered_ago(self, device: str) -> float | None:
        """Seconds since ``device`` acked the last payload sent to it; None while it is on its way or failed."""
        ...

    def close_round(self, round_: int) -> None:
        """Round ``round_`` and those before it are closed: stop what still travels for them, both ways, so
        it cannot hold up the next round's assignments and uploads."""
        ...

    def bytes_up(self, device: str) -> int:
        """Bytes received from ``device`` so far (payloads and control, framing included)."""
        ...

    def bytes_down(self, device: str) -> int:
        """Bytes sent to ``device`` so far."""
        ...


def _of_closed_round(closed: int, manifest: Manifest) -> bool:
    return manifest.round <= closed


def _by_device(handler: Callable[[str, Any], None], what: str) -> Callable[[str, Any], None]:
    """A topic-keyed session callback that hands ``handler`` the device id; anything else is logged and dropped."""

    def on_topic(topic: str, item: Any) -> None:
        device = device_of(topic)
        if device is None:
            log.warning("%s on %s, outside any device's subtree; ignored", what, topic)
            return
        handler(device, item)

    return on_topic


class TransferCarrier(Protocol):
    """What carries chunked transfers (an MQTT session, a WebSocket endpoint): a closed round's stop both ways."""

    def cancel(self, stale: Callable[[Manifest], bool], why: str) -> int: ...

    def refuse(self, stale: Callable[[Manifest], bool], why: str) -> int: ...


class ChunkedLink(ABC):
    """A Link over the chunked-transfer engine: a model is hashed once (a sealed manifest) for every device it goes
    to, each device's delivery is watched, and closing a round stops what still travels for it both ways."""

    kind = "chunked"

    def __init__(self) -> None:
        self._deliveries: dict[str, Delivery] = {}

    @abstractmethod
    def _carrier(self) -> TransferCarrier: ...

    @abstractmethod
    def _chunk_size(self) -> int: ...

    @abstractmethod
    def _send(self, device: str, payload: bytes, manifest: Manifest) -> Delivery: ...

    def prepare(self, payload: bytes, **fields: Any) -> Manifest:
        return make_manifest(payload, self._chunk_size(), **fields)

    def send_payload(self, device: str, payload: bytes, outgoing: Outgoing) -> str:
        if not isinstance(outgoing, Manifest):
            raise TypeError(f"the {self.kind} link sends what its prepare() made, not a {type(outgoing).__name__}")
        delivery = self._send(device, payload, outgoing)
        self._deliveries[device] = delivery
        return delivery.transfer

    def payload_in_flight(self, device: str) -> bool:
        delivery = self._deliveries.get(device)
        return delivery is not None and not delivery.done and delivery.error is None

    def delivered_ago(self, device: str) -> float | None:
        delivery = self._deliveries.get(device)
        if delivery is None or not delivery.done or delivery.settled_at is None:
            return None
        return time.monotonic() - delivery.settled_at

    def close_round(self, round_: int) -> None:
        """Models still on their way to devices stop; a device's update for a closed round is refused at its
        manifest, before its chunks reach the coordinator, and the agent stops sending it (no receipt to wait for)."""
        carrier = self._carrier()
        closed = partial(_of_closed_round, round_)
        stopped = carrier.cancel(closed, f"round {round_} closed")
        dropped = carrier.refuse(closed, f"round {round_} is closed; its updates are no longer taken")
        if stopped or dropped:
            log.info("round %d closed: %d downloads stopped, %d unfinished uploads dropped", round_, stopped, dropped)


class MqttLink(ChunkedLink):
    """A fleet over an MQTT broker: one coordinator session, per-device topics under the fleet's name."""

    kind = "MQTT"

    def __init__(
        self, fleet: str, broker: BrokerAddress, limits: InboundLimits | None = None, **session_config: Any
    ) -> None:
        super().__init__()
        self.fleet = fleet
        self.broker = broker
        self.limits = limits or InboundLimits()
        self.session_config = session_config
        self.session: Session | None = None
        self._topics: dict[str, DeviceTopics] = {}

    @classmethod
    def of(cls, fleet: Fleet, broker: BrokerAddress, **session_config: Any) -> MqttLink:
        """The link of ``fleet``, its devices held to fleet.yaml's ``limits``."""
        return cls(fleet.fleet, broker, fleet.inbound_limits(), **session_config)

    def topics(self, device: str) -> DeviceTopics:
        if device not in self._topics:
            self._topics[device] = DeviceTopics(self.fleet, device)
        return self._topics[device]

    def start(
        self,
        on_message: MessageHandler,
        on_payload: PayloadHandler,
        on_refused: RefusalHandler = _ignore_refusal,
        timeout: float = 30.0,
    ) -> None:
        self.session = coordinator_session(
            self.fleet,
            self.broker,
            on_message=_by_device(on_message, "message"),
            on_payload=_by_device(lambda device, completed: on_payload(device, Received.of(completed)), "payload"),
            guard=InboundGuard(self.limits, on_refused, f"fleet {self.fleet}"),
            **self.session_config,
        )
        self.session.start(timeout=timeout)

    def _session(self) -> Session:
        if self.session is None:
            raise RuntimeError("the MQTT link is not started")
        return self.session

    def stop(self) -> None:
        if self.session is not None:
            self.session.stop()

    def send_control(self, device: str, message: Message) -> None:
        self._session().publish(self.topics(device).down, message)

    def _carrier(self) -> Session:
        return self._session()

    def _chunk_size(self) -> int:
        return self._session().config.chunk_size

    def _send(self, device: str, payload: bytes, manifest: Manifest) -> Delivery:
        return self._session().send(self.topics(device).down, payload, manifest=manifest)

    def bytes_up(self, device: str) -> int:
        return self._session().stats.bytes_in.get(self.topics(device).up, 0)

    def bytes_down(self, device: str) -> int:
        return self._session().stats.bytes_out.get(self.topics(device).down, 0)


__all__ = ["Link", "MessageHandler", "MqttLink", "Outgoing", "PayloadHandler", "RefusalHandler"]
