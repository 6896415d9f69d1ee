"""Start, watch and stop real ``device-agent run`` processes: the emulated devices of one host.

Each agent runs in its own session, so a Ctrl-C in the terminal reaches only the launcher, which
then stops the agents in order (SIGINT, the agent's own clean shutdown, then SIGKILL for any that
hang). On Linux each agent also gets a parent-death signal, so a launcher killed with -9 leaves no
orphaned agents behind. An agent that exits while it should be running is reported with the end
of its log, never silently dropped.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from device_agent.common.processes import die_with_parent
from device_agent.emulation.limits import thread_env
from device_agent.emulation.packing import batch_flags

_TAIL_LINES = 15


@dataclass(frozen=True)
class AgentSpec:
    """One agent to launch: its config file, where its output goes, extra environment (e.g. the password)."""

    device: str
    config: Path
    log: Path
    threads: int = 1
    env: Mapping[str, str] = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class AgentExit:
    """An agent process that ended, with the last lines of its log."""

    device: str
    returncode: int
    log: Path
    tail: str

    @property
    def crashed(self) -> bool:
        return self.returncode != 0

    def describe(self) -> str:
        how = f"killed by signal {-self.returncode}" if self.returncode < 0 else f"exit code {self.returncode}"
        text = f"agent {self.device} exited ({how}); log: {self.log}"
        return f"{text}\n{self.tail}" if self.tail else text


def agent_command(config: Path) -> list[str]:
    """The command of one agent: this interpreter's ``device-agent run``, so it runs the same installed code."""
    return [sys.executable, "-m", "device_agent", "run", "--config", str(config)]


def worker_command(agent_list: Path, threads: int = 1, batch: bool | None = None) -> list[str]:
    """The command of one worker hosting the devices listed in ``agent_list`` (:mod:`device_agent.emulation.worker`);
    ``batch``: True / False its devices' training steps batched where cheaper / one by one, None the worker's
    default (batched on CUDA only)."""
    command = [sys.executable, "-m", "device_agent", "worker", "--agents", str(agent_list), "--threads", str(threads)]
    return [*command, *batch_flags(batch)]


def write_agent_list(path: Path, configs: list[Path]) -> Path:
    """What ``device-agent worker --agents`` reads: a YAML list of agent.yaml paths (absolute)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"- {json.dumps(str(Path(c).resolve()))}\n" for c in configs))
    return path


def worker_malloc_env() -> dict[str, str]:
    """glibc malloc for a worker: one arena (an operator's own ``MALLOC_ARENA_MAX`` wins).

    By default each allocating thread gets an arena of its own and keeps its freed activations there, so
    a worker's memory grew with its device threads rather than with what computes at once: 32 threads
    training the demo CNN at 28x28 (batch 128) one at a time held +5,762 MiB with the default arenas and
    +729 MiB with one (docs/emulation.md). The devices take turns in the compute slot, so one arena is
    not contended.
    """
    return {"MALLOC_ARENA_MAX": os.environ.get("MALLOC_ARENA_MAX", "1")}


def pack_specs(specs: list[AgentSpec], slices: list[range], folder: Path) -> list[AgentSpec]:
    """One worker spec per slice of ``specs``: ``folder/worker-NN.yaml`` lists its agent.yaml files.

    The worker's environment is its devices' environments merged, so each device's password
    variable must have a name of its own (see :func:`device_agent.emulation.profile_config.password_env`).
    """
    workers = []
    for number, devices in enumerate(slices):
        members = [specs[i] for i in devices]
        env = worker_malloc_env()
        for member in members:
            clash = set(env) & set(member.env)
            if clash:
                raise ValueError(f"devices packed together share environment variable(s) {', '.join(sorted(clash))}")
            env.update(member.env)
        name = f"worker-{number:02d}"
        agent_list = write_agent_list(folder / f"{name}.yaml", [m.config for m in members])
        workers.append(AgentSpec(name, agent_list, folder / f"{name}.log", max(m.threads for m in members), env))
    return workers


def log_tail(path: Path, lines: int = _TAIL_LINES) -> str:
    try:
        with open(path, "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - 16_384))
            text = log.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join("    " + line for line in text.splitlines()[-lines:])


class AgentGroup:
    """The agent processes of one emulation; use as a context manager so they are always stopped."""

    def __init__(self, command: Callable[[Path], list[str]] = agent_command) -> None:
        self._command = command
        self._processes: dict[str, subprocess.Popen[bytes]] = {}
        self._specs: dict[str, AgentSpec] = {}
        self._reported: set[str] = set()
        self._on_exit: Callable[[AgentExit], None] | None = None
        self.killed: list[str] = []
        self._lock = threading.Lock()
        self._watcher: threading.Thread | None = None
        self._stop_watching = threading.Event()

    def __enter__(self) -> AgentGroup:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    @property
    def pids(self) -> dict[str, int]:
        return {device: process.pid for device, process in self._processes.items()}

    def start(self, spec: AgentSpec) -> int:
        """Launch one agent; its stdout and stderr are appended to ``spec.log``. Returns its pid."""
        if spec.device in self._processes:
            raise ValueError(f"agent {spec.device} is already running")
        spec.log.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **thread_env(spec.threads), **spec.env}
        with open(spec.log, "ab") as log:
            process = subprocess.Popen(
                self._command(spec.config),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        with self._lock:
            self._processes[spec.device] = process
            self._specs[spec.device] = spec
        return process.pid

    def running(self) -> list[str]:
        return [device for device, process in self._processes.items() if process.poll() is None]

    def poll(self) -> list[AgentExit]:
        """Agents that have exited since the last call (each reported once)."""
        exits = []
        with self._lock:
            for device, process in self._processes.items():
                code = process.poll()
                if code is not None and device not in self._reported:
                    self._reported.add(device)
                    exits.append(AgentExit(device, code, self._specs[device].log, log_tail(self._specs[device].log)))
        return exits

    def watch(self, on_exit: Callable[[AgentExit], None], interval: float = 0.5) -> None:
        """Call ``on_exit`` from a background thread for every agent that ends before :meth:`stop`."""
        self._on_exit = on_exit

        def loop() -> None:
            while not self._stop_watching.wait(interval):
                for exit_ in self.poll():
                    on_exit(exit_)

        self._watcher = threading.Thread(target=loop, name="agent-watch", daemon=True)
        self._watcher.start()

    def stop(self, timeout: float = 15.0) -> list[AgentExit]:
        """Stop every agent: SIGINT (its clean shutdown), then SIGKILL after ``timeout`` (listed in ``killed``).

        Returns the agents that had already ended on their own and were not reported yet (they also go
        to the ``watch`` callback), so a crash just before the end is not lost.
        """
        self._stop_watching.set()
        if self._watcher is not None:
            self._watcher.join()
            self._watcher = None
        early = self.poll()
        if self._on_exit is not None:
            for exit_ in early:
                self._on_exit(exit_)
        for process in self._processes.values():
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGINT)
        deadline = time.monotonic() + timeout
        for device, process in self._processes.items():
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                self.killed.append(device)
        with self._lock:
            self._reported.update(self._processes)
        return early
