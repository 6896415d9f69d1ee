"""The join of the transfer engine with WebSocket connections, one per route (a peer), at either end.

The engine (``device_agent.wire.engine``) keeps every transfer; this class feeds it the frames read from each
connection (on that connection's reader thread), writes what it returns through the connection's
:class:`~device_agent.wire.websocket.pipe.Pipe`, and runs MQTT's session machinery around it: the send window
(``window.SendWindow``), the transfer timer and the handler dispatcher (``timer``). Routes are peers: a device
id at the coordinator, the coordinator's name at a device. A frame for a route without a connection is
dropped; when the peer connects again its unfinished transfers are resumed (senders re-announce, receivers
nack what they lack), so nothing relies on a queue surviving a disconnect.

What a peer sends is read as MQTT's coordinator reads it: every frame passes ``admit`` first (the peer's rate
budget), a malformed message is logged, counted and dropped, one of another protocol version is answered
``incompatible`` once per burst, and a chunk frame is hashed before it is filed.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from device_agent.wire.delivery import Delivery
from device_agent.wire.engine import Arrived, Completed, Outbound, OutgoingTransfer, Outputs, TransferEngine
from device_agent.wire.engine.frames import chunk_is_intact, is_chunk_frame, parse_chunk_frame
from device_agent.wire.engine.manifests import DEFAULT_CHUNK_SIZE, Limits, for_sending
from device_agent.wire.guard import InboundGuard
from device_agent.wire.hashing import shared_pool
from device_agent.wire.messages import (
    Ack,
    Error,
    Manifest,
    Message,
    Nack,
    ProtocolError,
    VersionMismatch,
    encode,
    incompatible,
    parse_message,
)
from device_agent.wire.timer import Dispatcher, Timer
from device_agent.wire.websocket.pipe import ChunkHook, Pipe
from device_agent.wire.window import SendWindow

log = logging.getLogger("fedfleet.wire")

MessageHandler = Callable[[str, Message], None]
PayloadHandler = Callable[[str, Completed], None]
Admit = Callable[[str, bool, float], bool]
"""Whether to read a frame at all: (route, is a chunk frame, now); a refusal is the caller's to count and log."""


@dataclass(frozen=True)
class WsSettings:
    """Transfer and connection settings of either end; the defaults are MQTT session's."""

    chunk_size: int = DEFAULT_CHUNK_SIZE
    limits: Limits = field(default_factory=Limits)
    """``max_packet_bytes`` is the largest WebSocket message either end reads (the server refuses bigger)."""
    resend_after_s: float = 5.0
    nack_after_s: float = 2.0
    max_attempts: int = 20
    tick_s: float = 0.2
    send_window_bytes: int = 32 * 2**20
    keepalive_s: float = 20.0
    """WebSocket ping interval; a peer silent for as long again after a ping is taken for gone."""
    reconnect_min_s: float = 1.0
    reconnect_max_s: float = 30.0


@dataclass
class WsStats:
    connects: int = 0
    rejected: int = 0
    bytes_in: dict[str, int] = field(default_factory=dict)
    bytes_out: dict[str, int] = field(default_factory=dict)


def _same(route: str) -> str:
    """Routes are peers here: the peer behind a route is the route."""
    return route


class Endpoint:
    """Transfers to and from peers over their connections; thread-safe.

    ``on_message(route, message)`` gets every valid control message but the transfer machinery's own,
    ``on_payload(route, completed)`` every verified payload once, both on the dispatcher thread. ``guard`` (a
    receiver facing untrusted peers) bounds their transfers and counts refusals; ``admit`` charges each frame
    before it is read.
    """

    def __init__(
        self,
        name: str,
        settings: WsSettings,
        on_message: MessageHandler | None = None,
        on_payload: PayloadHandler | None = None,
        guard: InboundGuard | None = None,
        admit: Admit | None = None,
        before_chunk_out: ChunkHook | None = None,
        after_chunk_in: ChunkHook | None = None,
    ) -> None:
        self.name = name
        self.settings = settings
        self.on_message = on_message
        self.on_payload = on_payload
        self._guard = guard
        self._admit = admit
        self._before_chunk_out = before_chunk_out
        self._after_chunk_in = after_chunk_in
        self.stats = WsStats()
        self._lock = threading.RLock()
        """Guards the engine's transfers, the deliveries and the pipes; never held while taking the window's."""
        self.engine = TransferEngine(name, settings.nack_after_s, settings.send_window_bytes, _same, guard)
        self._pipes: dict[str, Pipe] = {}
        self._deliveries: dict[str, Delivery] = {}
        self._hashing = shared_pool()
        self.dispatcher = Dispatcher(name)
        self.timer = Timer(
            name, settings.tick_s, self._lock, self.engine.busy, lambda: self._pump(retry=False), self._tick
        )
        self.window = SendWindow(self.engine, self.timer.due)
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        for target, what in ((self.dispatcher.run, "dispatch"), (lambda: self.timer.run(self._stopping), "tick")):
            thread = threading.Thread(target=target, name=f"fedfleet-ws-{what}-{self.name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stopping.set()
        self.timer.due.set()
        with self._lock:
            pipes, self._pipes = list(self._pipes.values()), {}
        for pipe in pipes:
            pipe.close()
        self.dispatcher.close()
        for thread in self._threads:
            thread.join(timeout=5)
        self._threads.clear()

    # ---- connections -----------------------------------------------------------------------

    def attach(self, route: str, send: Callable[[bytes], None]) -> Pipe:
        """``route``'s peer is connected through ``send``; a connection it had before is dropped (it replaced
        it). Its unfinished transfers resume at once."""
        pipe = Pipe(f"{self.name}-{route}", send, self.window.settle, self._before_chunk_out)
        with self._lock:
            previous = self._pipes.get(route)
            self._pipes[route] = pipe
            self.stats.connects += 1
            frames = self.engine.resume(time.monotonic(), route)
        if previous is not None:
            previous.close()
        self._apply(frames)
        self.timer.wake()
        self._pump()
        return pipe

    def detach(self, route: str, pipe: Pipe) -> bool:
        """``pipe``'s connection closed; False when a newer connection of the same peer had replaced it."""
        pipe.close()
        with self._lock:
            if self._pipes.get(route) is not pipe:
                return False
            del self._pipes[route]
        return True

    def flush(self, route: str, timeout: float) -> bool:
        """Wait until what was queued for ``route`` so far is written; True at once without a connection."""
        with self._lock:
            pipe = self._pipes.get(route)
        return pipe is None or pipe.flush(timeout)

    def connected(self, route: str) -> bool:
        with self._lock:
            return route in self._pipes

    # ---- sending ---------------------------------------------------------------------------

    def publish(self, route: str, message: Message) -> bool:
        """Send one control message; False when ``route`` has no connection (it is dropped)."""
        return self._write(route, encode(message))

    def send(self, route: str, payload: bytes, manifest: Manifest | None = None, **fields: Any) -> Delivery:
        """Start a verified chunked transfer of ``payload`` to ``route`` (see ``Session.send``: the same rules)."""
        settings = self.settings
        manifest = for_sending(payload, manifest, settings.chunk_size, settings.limits, **fields)
        outgoing = OutgoingTransfer(manifest, payload, time.monotonic(), settings.resend_after_s, settings.max_attempts)
        delivery = Delivery(outgoing.transfer)
        with self._lock:
            self._deliveries[outgoing.transfer] = delivery
            self.engine.senders.add(route, outgoing)
        self.window.enqueue(route, outgoing.transfer, outgoing.start(self._hashing.map))
        self.timer.wake()
        self._pump()
        return delivery

    def cancel(self, stale: Callable[[Manifest], bool], why: str) -> int:
        """Stop sending every transfer whose manifest is ``stale``; their deliveries fail with ``why``."""
        with self._lock:
            cancelled = self.engine.cancel(stale, why)
        self._apply(cancelled)
        return len(cancelled)

    def refuse(self, stale: Callable[[Manifest], bool], why: str) -> int:
        """Answer every new inbound transfer whose manifest is ``stale`` with an error (``Session.refuse``)."""
        with self._lock:
            return self.engine.refuse(stale, why)

    def _write(self, route: str, data: bytes, windowed: int = 0) -> bool:
        with self._lock:
            pipe = self._pipes.get(route)
        if pipe is None or not pipe.put(data, windowed):
            if windowed and pipe is None:
                self.window.settle(windowed)
            return False
        self.stats.bytes_out[route] = self.stats.bytes_out.get(route, 0) + len(data)
        return True

    def _pump(self, retry: bool = True) -> None:
        self.window.pump(lambda route, data, _transfer: self._write(route, data, len(data)), retry)

    def _tick(self, now: float) -> None:
        """Re-announcements, nacks and expiries due, while a peer is connected (MQTT's session: while connected):
        with nobody to hear them they would only spend a transfer's attempts."""
        with self._lock:
            if not self._pipes:
                return
        waiting = self.window.waiting()
        with self._lock:
            outputs = self.engine.tick(now, waiting)
        self._apply(outputs)

    def _apply(self, outputs: Outputs) -> None:
        """Write the engine's frames, hand over its payloads and settle its deliveries (never under the lock)."""
        for out in outputs:
            if isinstance(out, Outbound):
                if out.transfer is None or out.transfer in self.engine.senders:
                    self._write(out.route, out.data)
            elif isinstance(out, Arrived):
                if self.on_payload is not None:
                    self.dispatcher.put(functools.partial(self.on_payload, out.route, out.completed))
            else:
                with self._lock:
                    delivery = self._deliveries.pop(out.transfer, None)
                if delivery is not None:
                    delivery.refused = out.refused
                    delivery.settle(out.error)

    # ---- receiving (each connection's reader thread) ---------------------------------------

    def receive(self, route: str, data: bytes | str, now: float | None = None) -> None:
        """One WebSocket message from ``route``'s peer: a chunk frame or a control message; anything else is
        refused as malformed. Never raises for what the peer sent."""
        now = time.monotonic() if now is None else now
        if isinstance(data, str):
            self._reject(route, ProtocolError("a text message; this protocol speaks binary messages only"), now)
            return
        chunk = is_chunk_frame(data)
        if self._admit is not None and not self._admit(route, chunk, now):
            return
        self.stats.bytes_in[route] = self.stats.bytes_in.get(route, 0) + len(data)
        if chunk:
            self._take_chunk(route, data, now)
            return
        try:
            message = parse_message(data)
        except ProtocolError as exc:
            self._reject(route, exc, now)
            return
        outputs: Outputs = ()
        with self._lock:
            if isinstance(message, Manifest):
                outputs = self.engine.on_manifest(route, message, now)
            elif isinstance(message, Ack | Nack):
                outputs = self.engine.on_answer(route, message, now)
            elif isinstance(message, Error):
                outputs = self.engine.on_error(message)
        if self.engine.busy():
            self.timer.wake()
        self._apply(outputs)
        if not isinstance(message, Manifest | Ack | Nack):
            self.tell(route, message)

    def tell(self, route: str, message: Message) -> None:
        """Hand ``message`` from ``route`` to the owner's handler, on the dispatcher thread."""
        if self.on_message is not None:
            self.dispatcher.put(functools.partial(self.on_message, route, message))

    def _take_chunk(self, route: str, frame: bytes, now: float) -> None:
        try:
            transfer, index, data, digest = parse_chunk_frame(frame)
        except ProtocolError as exc:
            self._reject(route, exc, now)
            return
        intact = chunk_is_intact(data, digest)  # on this connection's thread: hashlib drops the GIL
        with self._lock:
            outputs = self.engine.on_chunk(route, transfer, index, data, digest, now, intact)
        self._apply(outputs)
        if self._after_chunk_in is not None:
            self._after_chunk_in(len(frame))

    def _reject(self, route: str, exc: ProtocolError, now: float) -> None:
        """Drop a malformed message; tell a peer of another protocol version to stop, once per burst."""
        self.stats.rejected += 1
        first = True
        if self._guard is not None:
            reason = "wrong_version" if isinstance(exc, VersionMismatch) else "malformed"
            first = self._guard.refuse_first(route, reason, f"from {route}: {exc}", now)
        else:
            log.warning("%s: rejected a message from %s: %s", self.name, route, exc)
        if isinstance(exc, VersionMismatch) and first:
            answer = incompatible(exc.version)
            self.publish(route, answer)
            self.tell(route, answer)


__all__ = ["Endpoint", "WsSettings", "WsStats"]
