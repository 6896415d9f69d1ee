"""What every carrier's join does with the sans-IO transfer engine: start, cancel and refuse transfers, and act on
what the engine returns outside the engine's lock.

A join (the MQTT :class:`~device_agent.wire.session.Session`, the WebSocket
:class:`~device_agent.wire.websocket.endpoint.Endpoint`) owns the engine, its lock, the deliveries it promised,
the transfer timer and the handler dispatcher. Its carrier says how a frame leaves (``_emit``), how the send
window is pumped (``_pump``) and whether anybody can hear the timer's re-announcements (``_carrying``).
"""

from __future__ import annotations

import functools
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Protocol

from device_agent.wire.delivery import Delivery
from device_agent.wire.engine import Arrived, Completed, Outbound, OutgoingTransfer, Outputs, TransferEngine
from device_agent.wire.engine.manifests import Limits, for_sending
from device_agent.wire.guard import InboundGuard
from device_agent.wire.hashing import shared_pool
from device_agent.wire.messages import Manifest, Message
from device_agent.wire.timer import Dispatcher, Timer
from device_agent.wire.window import SendWindow

MessageHandler = Callable[[str, Message], None]
PayloadHandler = Callable[[str, Completed], None]


class TransferSettings(Protocol):
    """The settings of a join's transfers (both carriers' settings have them under these names). Read-only: the
    carriers' settings are frozen dataclasses, and a join only reads them."""

    @property
    def chunk_size(self) -> int: ...
    @property
    def limits(self) -> Limits: ...
    @property
    def resend_after_s(self) -> float: ...
    @property
    def max_attempts(self) -> int: ...
    @property
    def nack_after_s(self) -> float: ...
    @property
    def send_window_bytes(self) -> int: ...
    @property
    def tick_s(self) -> float: ...


class EngineJoin(ABC):
    """The transfer engine joined to a carrier; the carrier's class sets ``window`` and the three hooks."""

    window: SendWindow

    def __init__(
        self,
        name: str,
        settings: TransferSettings,
        route_of: Callable[[str], str],
        guard: InboundGuard | None,
        on_message: MessageHandler | None,
        on_payload: PayloadHandler | None,
    ) -> None:
        self._transfers = settings
        self._on_message = on_message
        self._on_payload = on_payload
        self._lock = threading.RLock()
        """Guards the engine's transfers and the deliveries (and what the carrier keeps beside them); never held
        while a frame is emitted (paho holds its own lock while it runs on_publish, which takes it) nor while
        taking the window's (``window.lock``): a frame built under that one may wait for the hashing pool, whose
        threads file chunks under this one."""
        self.engine = TransferEngine(name, settings.nack_after_s, settings.send_window_bytes, route_of, guard)
        self._deliveries: dict[str, Delivery] = {}
        self._hashing = shared_pool()
        self.dispatcher = Dispatcher(name)
        self.timer = Timer(
            name,
            settings.tick_s,
            self._lock,
            busy=self.engine.busy,
            pump=lambda: self._pump(retry=False),
            tick=lambda now: self._tick(now),  # late-bound: a test may wrap _tick
        )

    @abstractmethod
    def _emit(self, route: str, data: bytes, transfer: str | None) -> None:
        """Send one frame the engine returned (never called with ``_lock`` held)."""

    @abstractmethod
    def _pump(self, retry: bool = True) -> None:
        """Send what the window lets out now."""

    @abstractmethod
    def _carrying(self) -> bool:
        """Whether a peer can hear frames now: re-announcements and nacks to nobody would only spend attempts."""

    # ---- sending ---------------------------------------------------------------------------

    def send(self, route: str, payload: bytes, manifest: Manifest | None = None, **manifest_fields: Any) -> Delivery:
        """Start a verified chunked transfer of ``payload`` to ``route``; refuse it now if it breaks a limit.

        Pass a ``manifest`` from ``make_manifest`` to send the same bytes to several receivers without
        rehashing (each send gets a fresh transfer id, unless ``transfer=`` names the one a signature
        binds); otherwise ``payload`` is announced with ``manifest_fields`` and hashed chunk by chunk
        as it is sent.
        """
        cfg = self._transfers
        manifest = for_sending(payload, manifest, cfg.chunk_size, cfg.limits, **manifest_fields)
        outgoing = OutgoingTransfer(manifest, payload, time.monotonic(), cfg.resend_after_s, cfg.max_attempts)
        delivery = Delivery(outgoing.transfer)
        with self._lock:
            self._deliveries[outgoing.transfer] = delivery
            self.engine.senders.add(route, outgoing)
        self.window.enqueue(route, outgoing.transfer, outgoing.start(self._hashing.map))
        self.timer.wake()
        self._pump()
        return delivery

    def cancel(self, stale: Callable[[Manifest], bool], why: str) -> int:
        """Stop sending every outgoing transfer whose manifest is ``stale`` (no more chunks, re-announcements
        or repairs); their deliveries fail with ``why``. How many were cancelled."""
        with self._lock:
            cancelled = self.engine.cancel(stale, why)
        self._apply(cancelled)
        return len(cancelled)

    def refuse(self, stale: Callable[[Manifest], bool], why: str) -> int:
        """From now on answer every new inbound transfer whose manifest is ``stale`` with an error saying ``why``,
        before any of its chunks is kept, and drop the unfinished ones already open (replaces the last rule).
        How many unfinished transfers were dropped."""
        with self._lock:
            return self.engine.refuse(stale, why)

    # ---- what the engine returns, acted on outside the lock ------------------------------------

    def _apply(self, outputs: Outputs, route: str | None = None) -> None:
        """Emit the engine's frames, hand over its payloads (from ``route``) and settle its deliveries."""
        for out in outputs:
            if isinstance(out, Outbound):
                if out.transfer is not None and out.transfer not in self.engine.senders:
                    continue  # cancelled, refused or failed on the way: its frames would only be dropped
                self._emit(out.route, out.data, out.transfer)
            elif isinstance(out, Arrived):
                if self._on_payload is not None:
                    self.dispatcher.put(functools.partial(self._on_payload, route or out.route, out.completed))
            else:
                with self._lock:
                    delivery = self._deliveries.pop(out.transfer, None)
                if delivery is not None:
                    delivery.refused = out.refused
                    delivery.settle(out.error)

    def _tick(self, now: float) -> None:
        """The timer's beat: re-announcements, nacks and expiries due, while a peer can hear them."""
        if not self._carrying():
            return
        waiting = self.window.waiting()
        with self._lock:
            outputs = self.engine.tick(now, waiting)
        self._apply(outputs)

    def _tell(self, route: str, message: Message) -> None:
        """Hand ``message`` from ``route`` to the owner's handler, on the dispatcher thread."""
        if self._on_message is not None:
            self.dispatcher.put(functools.partial(self._on_message, route, message))
