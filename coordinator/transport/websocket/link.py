"""The engine's :class:`~coordinator.transport.link.Link` over the fleet's WebSocket server.

MqttLink's twin on the same chunked-transfer engine (:class:`~coordinator.transport.link.ChunkedLink`);
routes are device ids.
"""

from __future__ import annotations

from coordinator.transport.link import ChunkedLink, MessageHandler, PayloadHandler, RefusalHandler, _ignore_refusal
from coordinator.transport.websocket.server import WsServer
from device_agent.wire.delivery import Delivery
from device_agent.wire.messages import Manifest, Message
from device_agent.wire.payload import Received
from device_agent.wire.websocket.endpoint import Endpoint


class WebSocketLink(ChunkedLink):
    """The devices connected to ``server``, addressed by device id."""

    kind = "WebSocket"

    def __init__(self, server: WsServer) -> None:
        super().__init__()
        self.server = server

    def start(
        self, on_message: MessageHandler, on_payload: PayloadHandler, on_refused: RefusalHandler = _ignore_refusal
    ) -> None:
        self.server.attach(on_message, lambda device, completed: on_payload(device, Received.of(completed)), on_refused)

    def stop(self) -> None:
        self.server.detach()

    def send_control(self, device: str, message: Message) -> None:
        self.server.endpoint.publish(device, message)

    def _carrier(self) -> Endpoint:
        return self.server.endpoint

    def _chunk_size(self) -> int:
        return self.server.endpoint.settings.chunk_size

    def _send(self, device: str, payload: bytes, manifest: Manifest) -> Delivery:
        return self.server.endpoint.send(device, payload, manifest=manifest)

    def bytes_up(self, device: str) -> int:
        return self.server.endpoint.stats.bytes_in.get(device, 0)

    def bytes_down(self, device: str) -> int:
        return self.server.endpoint.stats.bytes_out.get(device, 0)


__all__ = ["WebSocketLink"]
