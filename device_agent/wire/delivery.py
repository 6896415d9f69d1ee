"""A payload on its way to its receiver, as its sender sees it."""

from __future__ import annotations

import threading
import time

from device_agent.wire.engine.manifests import TransferError


class Delivery:
    """A payload on its way; ``wait`` returns once the receiver acked the verified bytes."""

    def __init__(self, transfer: str) -> None:
        self.transfer = transfer
        self._event = threading.Event()
        self.error: str | None = None
        self.settled_at: float | None = None
        """When the receiver acked it or it failed (``time.monotonic()``)."""
        self.refused = False
        """The receiver answered with an error (it will not take these bytes): sending them again is pointless."""

    @property
    def done(self) -> bool:
        return self._event.is_set() and self.error is None

    def settle(self, error: str | None = None) -> None:
        """Acked (``error`` None) or failed; wakes every waiter."""
        self.error = error
        self.settled_at = time.monotonic()
        self._event.set()

    def wait(self, timeout: float | None = None) -> None:
        if not self._event.wait(timeout):
            raise TimeoutError(f"transfer {self.transfer} not acknowledged within {timeout} s")
        if self.error is not None:
            raise TransferError(f"transfer {self.transfer} failed: {self.error}")
