"""The send window: most bytes of chunk frames handed to the MQTT client and not yet confirmed by the broker.

Without it a coordinator pushing a model to 1,000 devices built every device's frames at once: ~500 MB queued
in paho (and in the broker) before the first device had its model. Transfers' first frames wait in a backlog,
in order, and leave as PUBACKs make room.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterator

# Publishes one frame of a transfer, counted in the window (the carrier's publish with windowed=True).
WindowedPublish = Callable[[str, bytes, str], None]


class SendWindow:
    """The backlog of transfers' first frames and the bytes in flight; thread-safe.

    ``room`` is set whenever bytes leave the window while frames wait: the session's timer thread pumps then.
    """

    def __init__(self, window_bytes: int, room: threading.Event) -> None:
        self.window_bytes = window_bytes
        self._room = room
        self._lock = threading.Lock()
        self._backlog: collections.deque[tuple[str, str, Iterator[bytes]]] = collections.deque()
        self._in_window = 0
        self._frame_sizes: dict[int, int] = {}
        """Per mid handed to the client, its bytes in the window (0: outside it); popped at its PUBACK."""
        self._acked_early: set[int] = set()
        """PUBACKs whose publish had not returned its mid yet (a fast broker answers before paho returns)."""
        self._pumping = threading.Lock()

    @property
    def in_window(self) -> int:
        """Bytes of chunk frames handed to the client and not yet confirmed by the broker."""
        return self._in_window

    def enqueue(self, topic: str, transfer: str, frames: Iterator[bytes]) -> None:
        """``transfer``'s first attempt waits its turn behind the transfers enqueued before it."""
        with self._lock:
            self._backlog.append((topic, transfer, frames))

    def waiting(self) -> set[str]:
        """Transfers still in the backlog: waiting for us, not for their receiver."""
        with self._lock:
            return {transfer for _topic, transfer, _frames in self._backlog}

    def pump(self, publish: WindowedPublish, live: Callable[[str], bool], retry: bool = True) -> None:
        """Publish backlog frames while the window has room (never from paho's thread: a link hook may block).

        One thread pumps at a time, so a transfer's frames leave in order (a seal overtaking the last chunk
        would draw a nack and a repair); a caller that finds another pumping leaves the rest to the timer thread
        (``retry``). The timer thread itself tries again at its next tick: while a shaped link holds the other
        pumper for seconds, asking itself again at once would spin. ``live(transfer)``: not finished, cancelled,
        refused or failed on the way.
        """
        if not self._pumping.acquire(blocking=False):
            if retry:
                self._room.set()
            return
        try:
            while True:
                with self._lock:
                    if not self._backlog or self._in_window >= self.window_bytes:
                        return
                    topic, transfer, frames = self._backlog[0]
                    frame = next(frames, None) if live(transfer) else None
                    if frame is None:
                        self._backlog.popleft()
                        continue
                    self._in_window += len(frame)
                publish(topic, frame, transfer)
        finally:
            self._pumping.release()

    def handed(self, mid: int, size: int) -> None:
        """The client took a frame as ``mid``; ``size`` its bytes in the window (0: outside it)."""
        with self._lock:
            if mid in self._acked_early:
                self._acked_early.discard(mid)
            else:
                self._frame_sizes[mid] = size
                size = 0
        if size:
            self.settle(size)

    def confirmed(self, mid: int) -> None:
        """The broker confirmed ``mid`` (its PUBACK)."""
        with self._lock:
            size = self._frame_sizes.pop(mid, None)
            if size is None:
                self._acked_early.add(mid)
        if size:
            self.settle(size)

    def settle(self, size: int) -> None:
        """``size`` bytes left the window: the backlog may go on (on the timer thread, see :meth:`pump`)."""
        with self._lock:
            self._in_window -= size
            more = bool(self._backlog)
        if more:
            self._room.set()

    def unacknowledged(self) -> bool:
        """Whether a publish handed to the client still waits for the broker's PUBACK."""
        with self._lock:
            return bool(self._frame_sizes)
