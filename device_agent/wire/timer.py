"""A session's two threads besides the network's: the transfer timer and the handler dispatcher."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

log = logging.getLogger("fedfleet.wire")

IDLE_TICK_S = 30.0
"""Longest sleep of an idle session's timer thread: a transfer that starts wakes it at once (one with transfers
ticks every ``tick_s``). A worker hosts hundreds of sessions, and each wake-up costs its process the GIL."""


class Timer:
    """Ticks every ``tick_s`` while a transfer is on its way either way (``busy()``), sleeps while none is.

    ``due`` is set to run ``pump`` at once (the send window made room, a transfer started); ``tick(now)`` runs
    at the busy pace. ``lock`` is the lock under which transfers are added: ``busy`` and :meth:`wake` take it,
    so a transfer added while the timer decides to sleep always wakes it.
    """

    def __init__(
        self,
        name: str,
        tick_s: float,
        lock: threading.RLock,
        busy: Callable[[], bool],
        pump: Callable[[], None],
        tick: Callable[[float], None],
    ) -> None:
        self._name = name
        self._tick_s = tick_s
        self._lock = lock
        self._busy = busy
        self._pump = pump
        self._tick = tick
        self.due = threading.Event()
        self.idle = False
        """The thread sleeps until woken (set and read under ``lock``)."""

    def run(self, stopping: threading.Event) -> None:
        due = time.monotonic() + self._tick_s
        while not stopping.is_set():
            self.due.wait(max(0.0, due - time.monotonic()))
            if stopping.is_set():
                return
            try:
                if self.due.is_set():
                    self.due.clear()
                    self._pump()
                now = time.monotonic()
                if not self.idle:  # woken from an idle sleep: tick at the busy pace from now on
                    due = min(due, now + self._tick_s)
                if now >= due:
                    self._pump()
                    self._tick(now)
                    due = now + (self._tick_s if self.busy() else IDLE_TICK_S)
            except Exception:
                log.exception("%s: error in the transfer timer (it keeps running)", self._name)

    def busy(self) -> bool:
        """Whether a transfer is on its way either way; the timer is idle until one starts if not."""
        with self._lock:
            busy = self._busy()
            self.idle = not busy
        return busy

    def wake(self) -> None:
        """A transfer started (after it was added): an idle timer ticks again."""
        with self._lock:
            idle, self.idle = self.idle, False
        if idle:
            self.due.set()


class Dispatcher:
    """Runs handlers one at a time on its own thread, so a slow or failing one never stalls the network's."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._events: queue.Queue[Callable[[], None] | None] = queue.Queue()

    def put(self, event: Callable[[], None]) -> None:
        self._events.put(event)

    def close(self) -> None:
        """The thread ends after the handlers already queued."""
        self._events.put(None)

    def run(self) -> None:
        while (event := self._events.get()) is not None:
            try:
                event()
            except Exception:
                log.exception("%s: error in a message handler (the session keeps running)", self._name)
            event = None  # a delivered payload is its receiver's now, not kept until the next message
