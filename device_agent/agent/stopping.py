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
    """On SIGINT or SIGTERM call ``stop``; exit with 128 + signal if the process still runs ``grace_s`` later,
    or at once on a second signal.

    Python runs a handler on the main thread between two bytecodes, maybe while that thread holds the
    lock ``stop`` needs (an Event's, in the middle of a wait). A handler calling ``stop`` itself then
    waits for its own thread forever: an agent outlived its killed coordinator that way, signal after
    signal. So the handler takes no lock: ``stop`` runs on a thread of its own, and the grace is a
    SIGALRM timer, which fires even while that thread waits.
    """
    received: list[int] = []

    def expire(_signum: int, _frame: object) -> None:
        exit_now(128 + received[0])

    def handler(signum: int, _frame: object) -> None:
        if received:
            exit_now(128 + signum)
            return
        received.append(signum)
        signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, grace_s)
        threading.Thread(target=stop, name="fedfleet-stop", daemon=True).start()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)
