"""SIGTERM stops an agent process gracefully, and at once when its graceful stop hangs."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

# A process whose stop either returns at once (graceful) or does nothing (a hung shutdown), then waits.
_PROCESS = """
import sys, threading
from device_agent.agent.stopping import stop_on_signals
done = threading.Event()
stop_on_signals(done.set if sys.argv[1] == "graceful" else (lambda: None), grace_s=0.5)
print("ready", flush=True)
done.wait(30)
"""


def run_and_terminate(mode: str) -> tuple[int, float]:
    """Exit code and seconds from SIGTERM to exit."""
    process = subprocess.Popen([sys.executable, "-c", _PROCESS, mode], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "ready"
    sent = time.monotonic()
    process.send_signal(signal.SIGTERM)
    code = process.wait(timeout=20)
    return code, time.monotonic() - sent


def test_a_stop_that_hangs_is_cut_short_after_the_grace_with_the_signal_s_exit_code() -> None:
    code, seconds = run_and_terminate("hung")
    assert code == 128 + signal.SIGTERM
    assert 0.5 <= seconds < 10


def test_a_graceful_stop_exits_normally_without_waiting_out_the_grace() -> None:
    code, _seconds = run_and_terminate("graceful")
    assert code == 0
