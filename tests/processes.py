"""Helpers for tests that run real processes (agents, coordinators): waiting on their logs, stopping them."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path


def wait_for_text(log: Path, text: str, process: subprocess.Popen, timeout: float = 120) -> None:
    """Until ``text`` is in ``log``: fails at once if ``process`` exits first, with the log's end in the message."""
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        assert process.poll() is None, f"exited ({process.returncode}) before {text!r}:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"no {text!r} in {timeout:g} s:\n{log.read_text()[-4000:]}"
        time.sleep(0.1)


def stop_processes(processes: Iterable[subprocess.Popen], timeout: float = 30) -> None:
    """SIGTERM each process still running (all first, so they stop together), then wait; kill what outlasts it."""
    processes = list(processes)
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
