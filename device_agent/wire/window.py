"""The send window on a paho client: the engine's window (``device_agent.wire.engine.window``) made thread-safe,
with each frame's bytes held until the broker's PUBACK of its message id.

Frames leave in order from one pumping thread at a time; PUBACKs, on paho's network thread, make room.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

from device_agent.wire.engine.core import TransferEngine

# Publishes one frame of a transfer, counted in the window (the carrier's publish with windowed=True).
WindowedPublish = Callable[[str, bytes, str | None], None]


class SendWindow:
    """``engine``'s window under :attr:`lock`, and the bytes of every message id paho has not confirmed.

    ``room`` is set whenever bytes leave the window while frames wait: the session's timer thread pumps then.
    """

    def __init__(self, engine: TransferEngine, room: threading.Event) -> None:
        self._engine = engine
        self._room = room
        self.lock = threading.Lock()
        """Guards the engine's window; never taken under the session's lock (see ``Session._lock``)."""
        self._frame_sizes: dict[int, int] = {}
        """Per mid handed to the client, its bytes in the window (0: outside it); popped at its PUBACK."""
        self._acked_early: set[int] = set()
        """PUBACKs whose publish had not returned its mid yet (a fast broker answers before paho returns)."""
        self._pumping = threading.Lock()

    @property
    def window_bytes(self) -> int:
        return self._engine.window.window_bytes

    @property
    def in_window(self) -> int:
        """Bytes of chunk frames handed to the client and not yet confirmed by the broker."""
        return self._engine.window.in_window

    def waiting(self) -> set[str]:
        """Transfers still in the backlog: waiting for us, not for their receiver."""
        with self.lock:
            return self._engine.window.waiting()

    def enqueue(self, topic: str, transfer: str, frames: Iterator[bytes]) -> None:
        with self.lock:
            self._engine.window.enqueue(topic, transfer, frames)

    def pump(self, publish: WindowedPublish, retry: bool = True) -> None:
        """Publish backlog frames while the window has room (never from paho's thread: a link hook may block).

        One thread pumps at a time, so a transfer's frames leave in order (a seal overtaking the last chunk
        would draw a nack and a repair); a caller that finds another pumping leaves the rest to the timer thread
        (``retry``). The timer thread itself tries again at its next tick: while a shaped link holds the other
        pumper for seconds, asking itself again at once would spin.
        """
        if not self._pumping.acquire(blocking=False):
            if retry:
                self._room.set()
            return
        try:
            while True:
                with self.lock:
                    frame = self._engine.next_frame()
                if frame is None:
                    return
                publish(frame.route, frame.data, frame.transfer)
        finally:
            self._pumping.release()

    def handed(self, mid: int, size: int) -> None:
        """The client took a frame as ``mid``; ``size`` its bytes in the window (0: outside it)."""
        with self.lock:
            if mid in self._acked_early:
                self._acked_early.discard(mid)
            else:
                self._frame_sizes[mid] = size
                size = 0
        if size:
            self.settle(size)

    def confirmed(self, mid: int) -> None:
        """The broker confirmed ``mid`` (its PUBACK)."""
        with self.lock:
            size = self._frame_sizes.pop(mid, None)
            if size is None:
                self._acked_early.add(mid)
        if size:
            self.settle(size)

    def settle(self, size: int) -> None:
        """``size`` bytes left the window: the backlog may go on (on the timer thread, see :meth:`pump`)."""
        with self.lock:
            more = self._engine.settle(size)
        if more:
            self._room.set()

    def unacknowledged(self) -> bool:
        """Whether a publish handed to the client still waits for the broker's PUBACK."""
        with self.lock:
            return bool(self._frame_sizes)
