"""One open WebSocket's sending side: its frames leave in order from a writer thread of its own.

A slow device then holds up only its own writer (the WebSocket's TCP window pushes back on it), never the
coordinator's other connections nor the thread that queued the frame. A frame counted in the send window is
settled once written, or dropped with the connection: MQTT's PUBACK, here the socket taking the bytes.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from device_agent.wire.engine.frames import is_chunk_frame

log = logging.getLogger("fedfleet.wire")

ChunkHook = Callable[[int], None]


class Pipe:
    """Frames to one peer: ``send(data)`` writes one WebSocket message; ``settle(n)`` frees ``n`` window bytes."""

    def __init__(
        self,
        name: str,
        send: Callable[[bytes], None],
        settle: Callable[[int], None],
        before_chunk_out: ChunkHook | None = None,
    ) -> None:
        self.name = name
        self._send = send
        self._settle = settle
        self._before_chunk_out = before_chunk_out
        self._queue: queue.SimpleQueue[tuple[bytes, int] | threading.Event | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.closed = threading.Event()
        self.bytes_out = 0
        self._thread = threading.Thread(target=self._run, name=f"fedfleet-ws-out-{name}", daemon=True)
        self._thread.start()

    def put(self, data: bytes, windowed: int = 0) -> bool:
        """Queue one frame (``windowed``: its bytes counted in the send window); False once the pipe is closed."""
        with self._lock:
            if not self.closed.is_set():
                self._queue.put((data, windowed))
                return True
        if windowed:
            self._settle(windowed)
        return False

    def flush(self, timeout: float) -> bool:
        """Wait until every frame queued so far is written (or dropped); False if ``timeout`` passed first."""
        written = threading.Event()
        with self._lock:
            if self.closed.is_set():
                return True
            self._queue.put(written)
        return written.wait(timeout)

    def close(self) -> None:
        """Stop writing; frames still queued are dropped (their transfers resume on the next connection)."""
        with self._lock:
            if self.closed.is_set():
                return
            self.closed.set()
            self._queue.put(None)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if isinstance(item, threading.Event):
                item.set()
                continue
            data, windowed = item
            try:
                if not self.closed.is_set():
                    if self._before_chunk_out is not None and is_chunk_frame(data):
                        self._before_chunk_out(len(data))
                    self._send(data)
                    self.bytes_out += len(data)
            except Exception as exc:  # the connection went away: its reader notices and detaches it
                log.debug("%s: a frame was not written (%s); the connection is closing", self.name, exc)
                self.closed.set()
            finally:
                if windowed:
                    self._settle(windowed)
