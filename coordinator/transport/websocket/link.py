"""The engine's :class:`~coordinator.transport.link.Link` over the fleet's WebSocket server.

MqttLink's twin: a model is hashed once (a sealed manifest) for every device it goes to, each device's
delivery is watched, and closing a round stops what still travels for it both ways. Routes are device ids.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Any

from coordinator.transport.link import MessageHandler, Outgoing, PayloadHandler, RefusalHandler, _ignore_refusal
from coordinator.transport.websocket.server import WsServer
from device_agent.wire.delivery import Delivery
from device_agent.wire.engine.manifests import make_manifest
from device_agent.wire.messages import Manifest, Message
from device_agent.wire.payload import Received

log = logging.getLogger("fedfleet.link")


def _of_closed_round(closed: int, manifest: Manifest) -> bool:
    return manifest.round <= closed


class WebSocketLink:
    """The devices connected to ``server``, addressed by device id."""

    def __init__(self, server: WsServer) -> None:
        self.server = server
        self._deliveries: dict[str, Delivery] = {}

    def start(
        self, on_message: MessageHandler, on_payload: PayloadHandler, on_refused: RefusalHandler = _ignore_refusal
    ) -> None:
        self.server.attach(on_message, lambda device, completed: on_payload(device, Received.of(completed)), on_refused)

    def stop(self) -> None:
        self.server.detach()

    def send_control(self, device: str, message: Message) -> None:
        self.server.endpoint.publish(device, message)

    def prepare(self, payload: bytes, **fields: Any) -> Manifest:
        return make_manifest(payload, self.server.endpoint.settings.chunk_size, **fields)

    def send_payload(self, device: str, payload: bytes, outgoing: Outgoing) -> str:
        if not isinstance(outgoing, Manifest):
            raise TypeError(f"the WebSocket link sends what its prepare() made, not a {type(outgoing).__name__}")
        delivery = self.server.endpoint.send(device, payload, manifest=outgoing)
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
        endpoint = self.server.endpoint
        closed = partial(_of_closed_round, round_)
        stopped = endpoint.cancel(closed, f"round {round_} closed")
        dropped = endpoint.refuse(closed, f"round {round_} is closed; its updates are no longer taken")
        if stopped or dropped:
            log.info("round %d closed: %d downloads stopped, %d unfinished uploads dropped", round_, stopped, dropped)

    def bytes_up(self, device: str) -> int:
        return self.server.endpoint.stats.bytes_in.get(device, 0)

    def bytes_down(self, device: str) -> int:
        return self.server.endpoint.stats.bytes_out.get(device, 0)


__all__ = ["WebSocketLink"]
