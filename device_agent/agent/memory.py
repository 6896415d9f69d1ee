"""An in-process transport: a switchboard (:class:`MemoryHub`) between one coordinator and real agents' ports.

What MQTT is to a fleet, the hub is to devices that live in the coordinator's process (``simulate()``,
``benchmarks.compare``, tests): the agents are the real :class:`~device_agent.agent.runtime.Agent`, with
their outbox, receipts, re-sends and kept state on disk; only the bytes take a shorter way. Like a
broker, the hub keeps each device's last retained messages (hello, status) for a coordinator that
attaches later, says ``offline`` for a device whose port stops, and drops what is sent to a device that
is not attached. Payloads are handed over whole, digested once as the transport's
:class:`~device_agent.wire.payload.PayloadDigest` so that signatures and the journal work as over MQTT.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from device_agent.agent.port import MessageHandler, PayloadHandler, Signer, Upload
from device_agent.wire.messages import Message, Status
from device_agent.wire.payload import PayloadDigest, Received
from device_agent.wire.transfer import DEFAULT_CHUNK_SIZE, new_transfer_id

DeviceMessageHandler = Callable[[str, Message], None]
DevicePayloadHandler = Callable[[str, Received], None]


class MemoryHub:
    """Routes messages and payloads between the coordinator and the devices attached to it; thread-safe."""

    def __init__(self, chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        self.chunk_size = chunk_size
        self._lock = threading.Lock()
        self._coordinator: tuple[DeviceMessageHandler, DevicePayloadHandler] | None = None
        self._devices: dict[str, tuple[MessageHandler, PayloadHandler]] = {}
        self._retained: dict[tuple[str, str], Message] = {}

    # ---- the coordinator's side ------------------------------------------------------------

    def attach_coordinator(self, on_message: DeviceMessageHandler, on_payload: DevicePayloadHandler) -> None:
        """From now on the coordinator hears every device; first what each device left retained."""
        with self._lock:
            self._coordinator = on_message, on_payload
            retained = list(self._retained.items())
        for (device, _type), message in retained:
            on_message(device, message)

    def detach_coordinator(self) -> None:
        with self._lock:
            self._coordinator = None

    def to_device(self, device: str, message: Message) -> bool:
        """Deliver ``message``; False when ``device`` is not attached (it is dropped, as for an offline device)."""
        handlers = self._device(device)
        if handlers is not None:
            handlers[0](message)
        return handlers is not None

    def payload_to_device(self, device: str, transfer: str, data: bytes) -> bool:
        handlers = self._device(device)
        if handlers is not None:
            handlers[1](transfer, data)
        return handlers is not None

    # ---- the devices' side -----------------------------------------------------------------

    def attach_device(self, device: str, on_message: MessageHandler, on_payload: PayloadHandler) -> None:
        with self._lock:
            if device in self._devices:
                raise ConnectionError(f"{device} is already attached to this hub (two agents with one identity)")
            self._devices[device] = on_message, on_payload

    def detach_device(self, device: str) -> None:
        with self._lock:
            self._devices.pop(device, None)

    def to_coordinator(self, device: str, message: Message, retain: bool = False) -> None:
        with self._lock:
            if retain:
                self._retained[(device, message.type)] = message
            coordinator = self._coordinator
        if coordinator is not None:
            coordinator[0](device, message)

    def retract(self, device: str, message_type: str) -> None:
        """Forget ``device``'s retained message of ``message_type`` (a device that leaves takes back its hello)."""
        with self._lock:
            self._retained.pop((device, message_type), None)

    def payload_to_coordinator(self, device: str, received: Received) -> None:
        with self._lock:
            coordinator = self._coordinator
        if coordinator is not None:
            coordinator[1](device, received)

    def _device(self, device: str) -> tuple[MessageHandler, PayloadHandler] | None:
        with self._lock:
            return self._devices.get(device)


@dataclass(frozen=True)
class HandedOver:
    """An upload given to the hub: whole at once, so done as soon as it is sent."""

    error: str | None = None
    done: bool = True
    refused: bool = False


class MemoryPort:
    """A device's :class:`~device_agent.agent.port.CoordinatorPort` on a :class:`MemoryHub`."""

    where = "this process (in-memory transport)"

    def __init__(self, hub: MemoryHub, device: str) -> None:
        self.hub, self.device = hub, device
        self._connects = 0

    def start(self, on_message: MessageHandler, on_payload: PayloadHandler, timeout: float | None = None) -> None:
        self.hub.attach_device(self.device, on_message, on_payload)
        self._connects = 1

    def stop(self) -> None:
        """Leave as an agent leaves a broker: say ``offline``, take back the hello, detach."""
        if self._connects:
            self.publish(Status(device=self.device, state="offline", detail="stopped"), retain=True)
            self.hub.retract(self.device, "hello")
            self.hub.detach_device(self.device)

    def publish(self, message: Message, retain: bool = False) -> None:
        self.hub.to_coordinator(self.device, message, retain)

    def send(self, payload: bytes, sign: Signer | None = None, **fields: Any) -> Upload:
        digest = PayloadDigest.of(payload, self.hub.chunk_size)
        meta: dict[str, Any] = dict(fields.get("meta") or {})
        received = Received(
            run=fields.get("run", ""),
            round=fields.get("round", 0),
            kind=fields.get("kind", "payload"),
            transfer=fields.get("transfer") or new_transfer_id(),
            meta=meta if sign is None else sign(digest.value, meta),
            digest=digest,
            data=payload,
        )
        self.hub.payload_to_coordinator(self.device, received)
        return HandedOver()

    def cancel(self, transfer: str) -> None:
        """Nothing to stop: an upload is handed over whole as it is sent."""

    @property
    def connects(self) -> int:
        return self._connects

    def fatal(self) -> str | None:
        """A hub never refuses a device."""
        return None


__all__ = ["HandedOver", "MemoryHub", "MemoryPort"]
