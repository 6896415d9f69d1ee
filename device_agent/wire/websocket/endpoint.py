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

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from device_agent.wire.engine import Outputs
from device_agent.wire.engine.frames import chunk_is_intact, is_chunk_frame, parse_chunk_frame
from device_agent.wire.engine.manifests import DEFAULT_CHUNK_SIZE, Limits
from device_agent.wire.guard import InboundGuard
from device_agent.wire.join import EngineJoin, MessageHandler, PayloadHandler
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
from device_agent.wire.websocket.pipe import ChunkHook, Pipe
from device_agent.wire.window import SendWindow

log = logging.getLogger("fedfleet.wire")

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


class Endpoint(EngineJoin):
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
        super().__init__(name, settings, _same, guard, on_message, on_payload)
        self.name = name
        self.settings = settings
        self._guard = guard
        self._admit = admit
        self._before_chunk_out = before_chunk_out
        self._after_chunk_in = after_chunk_in
        self.stats = WsStats()
        self._pipes: dict[str, Pipe] = {}
        """Each connected peer's connection, under ``_lock``."""
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

    def _emit(self, route: str, data: bytes, transfer: str | None) -> None:
        self._write(route, data)

    def _carrying(self) -> bool:
        """MQTT's session: while connected."""
        with self._lock:
            return bool(self._pipes)

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
            self._tell(route, message)

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
            self._tell(route, answer)


__all__ = ["Endpoint", "WsSettings", "WsStats"]
