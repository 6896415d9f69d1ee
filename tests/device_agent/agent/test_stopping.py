"""SIGTERM stops an agent process gracefully, and at once when its graceful stop hangs."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

# A process whose stop either returns at once (graceful) or does nothing (a hung shutdown), then waits.
# The stop says it started (so a test can wait for the first signal to be handled), then returns at once
# (graceful) or does nothing more (a hung shutdown); the process then waits. argv: mode, grace in seconds.
_PROCESS = """
import sys, threading
from device_agent.agent.stopping import stop_on_signals
done = threading.Event()
def stop():
    print("stopping", flush=True)
    if sys.argv[1] == "graceful":
        done.set()
stop_on_signals(stop, grace_s=float(sys.argv[2]))
print("ready", flush=True)
done.wait(60)
"""


def run_and_terminate(mode: str) -> tuple[int, float]:
    """Exit code and seconds from SIGTERM to exit."""
    process = subprocess.Popen([sys.executable, "-c", _PROCESS, mode, "0.5"], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "ready"
    sent = time.monotonic()
    process.send_signal(signal.SIGTERM)
    code = process.wait(timeout=60)
    return code, time.monotonic() - sent


def test_a_stop_that_hangs_is_cut_short_after_the_grace_with_the_signal_s_exit_code() -> None:
    code, seconds = run_and_terminate("hung")
    assert code == 128 + signal.SIGTERM
    assert 0.5 <= seconds < 10


def test_a_graceful_stop_exits_normally_without_waiting_out_the_grace() -> None:
    code, _seconds = run_and_terminate("graceful")
    assert code == 0


_HOLDING = """
import sys, threading, time
from device_agent.agent.stopping import stop_on_signals
stopping = threading.Event()
stop_on_signals(stopping.set, grace_s=1.0)
with stopping._cond:  # as mid-wait on the Event: the lock ``stopping.set`` needs is held by this thread
    print("ready", flush=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.05)
"""


def test_a_signal_arriving_while_the_main_thread_holds_the_stop_s_lock_still_exits_after_the_grace() -> None:
    # Python runs the handler on the main thread between two bytecodes; a handler that set the Event itself
    # waited for a lock its own thread held, and an agent outlived its killed coordinator for good.
    process = subprocess.Popen([sys.executable, "-c", _HOLDING], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "ready"
    sent = time.monotonic()
    process.send_signal(signal.SIGTERM)
    code = process.wait(timeout=90)
    assert code == 128 + signal.SIGTERM
    assert time.monotonic() - sent < 30  # the grace (1 s; slower on a loaded host), not the 60 s the lock is held


def test_a_second_signal_exits_at_once() -> None:
    # A grace far longer than the test waits: the exit can only come from the second signal.
    process = subprocess.Popen([sys.executable, "-c", _PROCESS, "hung", "60"], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "ready"
    process.send_signal(signal.SIGINT)
    assert process.stdout.readline().strip() == "stopping"  # the first signal was handled
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 128 + signal.SIGTERM
