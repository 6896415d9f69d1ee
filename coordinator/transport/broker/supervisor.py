"""Keeps a managed broker alive for the coordinator's whole run.

Without it a broker killed by the OOM killer or a stray ``kill -9`` stays a zombie, nobody says so,
and every device times out. The supervisor reaps it, logs what happened, restarts it on the same
config and port (devices reconnect by themselves) and gives up after ``max_restarts`` crashes within
``window_s``, telling the coordinator to stop. A pid file in the run directory lets the next start find
a broker that a killed coordinator left behind and end it, instead of talking to the stale one.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from coordinator.transport.broker import pidfile
from coordinator.transport.broker.base import BrokerError
from coordinator.transport.broker.credentials import Credentials
from device_agent.wire.session import BrokerAddress

log = logging.getLogger("fedfleet.broker")

PID_FILE = "broker.pid"


class ProcessBroker(Protocol):
    """A managed broker that runs as a child process (mosquitto, the kit's mosquitto, amqtt)."""

    protocol: str

    @property
    def process(self) -> subprocess.Popen[bytes] | None: ...

    def start(self, timeout: float = 10.0) -> None: ...

    def stop(self, timeout: float = 10.0) -> None: ...

    def address_for(self, credentials: Credentials) -> BrokerAddress: ...


class BrokerSupervisor:
    """``start()`` ends a stale broker named by ``pid_file``, starts ours and watches it; ``stop()`` ends both."""

    def __init__(
        self,
        broker: ProcessBroker,
        pid_file: Path,
        *,
        max_restarts: int = 5,
        window_s: float = 300.0,
        interval_s: float = 0.5,
        on_give_up: Callable[[str], object] = lambda _why: None,
    ) -> None:
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
        self.broker = broker
        self.pid_file = Path(pid_file)
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.interval_s = interval_s
        self.on_give_up = on_give_up
        self.restarts: list[float] = []
        self.failure: str | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def protocol(self) -> str:
        return self.broker.protocol

    def address_for(self, credentials: Credentials) -> BrokerAddress:
        return self.broker.address_for(credentials)

    def start(self, timeout: float = 10.0) -> None:
        self.stop_stale()
        self.broker.start(timeout)
        self._record()
        self._stopping.clear()
        self._thread = threading.Thread(target=self._watch, name="broker-supervisor", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self.broker.stop(timeout)
        self.pid_file.unlink(missing_ok=True)

    def stop_stale(self) -> int | None:
        """End the broker a killed coordinator of this run left running; returns its pid, if there was one."""
        pid = pidfile.live_owner(self.pid_file)
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            return None
        command = pidfile.command_line(pid)
        if "mosquitto" not in command and "amqtt" not in command:
            raise BrokerError(
                f"{self.pid_file} names pid {pid}, which runs {command or 'something else'!r}, not a broker; "
                "remove the file if that process is not an earlier coordinator's broker"
            )
        log.warning("stopping the broker (pid %d) an earlier coordinator of this run left running", pid)
        pidfile.end(pid)
        self.pid_file.unlink(missing_ok=True)
        return pid

    def _record(self) -> None:
        process = self.broker.process
        if process is not None:
            pidfile.record(self.pid_file, process.pid)

    def _watch(self) -> None:
        while not self._stopping.wait(self.interval_s):
            process = self.broker.process
            if process is None or process.poll() is None:
                continue
            if not self._restart(process):
                return

    def _restart(self, crashed: subprocess.Popen[bytes]) -> bool:
        """Reap, report and restart a crashed broker; False once the restart budget is spent."""
        code = crashed.returncode
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
        log.error("the broker (pid %d) %s; restarting it on the same port", crashed.pid, how)
        while not self._stopping.is_set():
            now = time.monotonic()
            self.restarts = [t for t in self.restarts if now - t < self.window_s] + [now]
            if len(self.restarts) > self.max_restarts:
                self.failure = (
                    f"the broker (pid {crashed.pid}) {how} and {self.max_restarts} restarts within "
                    f"{self.window_s:.0f} s did not keep it up; giving up"
                )
                log.error("%s", self.failure)
                self.on_give_up(self.failure)
                return False
            self.broker.stop()
            try:
                self.broker.start()
            except BrokerError as exc:
                log.error("broker restart %d failed: %s", len(self.restarts), exc)
                self._stopping.wait(1.0)
                continue
            self._record()
            log.warning("broker restarted (restart %d of at most %d)", len(self.restarts), self.max_restarts)
            return True
        return False
