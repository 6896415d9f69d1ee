"""SIGINT/SIGTERM stop an agent process gracefully, and at once if the graceful stop hangs.

A graceful stop disconnects and joins the session's threads. Once, in CI, an agent outlived its
killed coordinator by more than 30 s, and a device that does not go when told keeps its slot
(systemd, the emulator and a second Ctrl-C all expect it gone). Exiting hard after a grace loses
nothing: an update waits in the durable outbox, and kept state and checkpoints are written atomically.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

STOP_GRACE_S = 10.0


def stop_on_signals(
    stop: Callable[[], None], grace_s: float = STOP_GRACE_S, exit_now: Callable[[int], object] = os._exit
) -> None:
    """On SIGINT or SIGTERM call ``stop``; if the process is still running ``grace_s`` later, exit with 128 + signal."""

    def handler(signum: int, _frame: object) -> None:
        stop()
        timer = threading.Timer(grace_s, exit_now, args=(128 + signum,))
        timer.daemon = True  # a stop that finishes in time exits without waiting for it
        timer.start()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)
