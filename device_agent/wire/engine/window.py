"""The send window: most bytes of chunk frames handed to the carrier and not yet confirmed by it.

Without it a coordinator pushing a model to 1,000 devices built every device's frames at once: ~500 MB queued
in paho (and in the broker) before the first device had its model. Transfers' first attempts wait in a backlog,
in order, and leave as confirmations make room; their frames are built (and hashed) only then.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator

from device_agent.wire.engine.events import Outbound


class Window:
    """The backlog of transfers' first attempts and the bytes in flight."""

    def __init__(self, window_bytes: int) -> None:
        self.window_bytes = window_bytes
        self._backlog: collections.deque[tuple[str, str, Iterator[bytes]]] = collections.deque()
        self.in_window = 0
        """Bytes of frames taken by :meth:`next` and not yet settled."""

    def __bool__(self) -> bool:
        """Whether a first attempt still waits for room."""
        return bool(self._backlog)

    def enqueue(self, route: str, transfer: str, frames: Iterator[bytes]) -> None:
        """``transfer``'s first attempt waits its turn behind the transfers enqueued before it."""
        self._backlog.append((route, transfer, frames))

    def waiting(self) -> set[str]:
        """Transfers still in the backlog: waiting for us, not for their receiver."""
        return {transfer for _route, transfer, _frames in self._backlog}

    def next(self, live: Callable[[str], bool]) -> Outbound | None:
        """The next frame to send while the window has room (its bytes counted in), or None.

        ``live(transfer)``: not finished, cancelled, refused or failed on the way; the rest of a transfer that
        is not is dropped unbuilt.
        """
        while self._backlog and self.in_window < self.window_bytes:
            route, transfer, frames = self._backlog[0]
            frame = next(frames, None) if live(transfer) else None
            if frame is None:
                self._backlog.popleft()
                continue
            self.in_window += len(frame)
            return Outbound(route, frame, transfer)
        return None

    def settle(self, size: int) -> bool:
        """``size`` bytes left the window (confirmed, or lost before they were sent); whether frames wait for room."""
        self.in_window -= size
        return bool(self._backlog)
