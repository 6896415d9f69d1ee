"""One agent per state directory, and a way for ``doctor`` to tell that it is running.

A fedfleet broker uses the login as the MQTT client id (``use_username_as_clientid``), so a second
connection with the device's login (a second agent, or ``doctor``'s login check) takes over the
running agent's session and disconnects it. ``device-agent run`` therefore holds an exclusive
``flock`` on ``STATE_DIR/agent.lock`` (with its pid inside) while it runs; the kernel drops the lock
when the process ends, however it ends, so a stale file never blocks a restart.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO

LOCK_NAME = "agent.lock"


class AlreadyRunning(RuntimeError):
    """Another agent holds this state directory's lock."""


def _pid_in(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def hold(state_dir: Path) -> IO[str]:
    """Take the state directory's lock and write this pid into it; keep the returned file open while running.

    Raises :class:`AlreadyRunning` naming the other agent's pid.
    """
    path = Path(state_dir) / LOCK_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(path, "a+")  # noqa: SIM115 - held for the process's lifetime
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        pid = _pid_in(path)
        raise AlreadyRunning(
            f"another device agent (pid {pid if pid is not None else 'unknown'}) is running with state dir "
            f"{state_dir}: two agents with one login take over each other's broker session; stop the other one"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


def running_agent(state_dir: Path) -> int | None:
    """The pid of the agent holding ``state_dir``'s lock (0 when its pid is unreadable), or None when none runs.

    Only looks: the lock is tried with a shared, non-blocking ``flock`` and released at once.
    """
    path = Path(state_dir) / LOCK_NAME
    try:
        handle = open(path)  # noqa: SIM115 - closed below
    except OSError:
        return None  # no file (no agent ever ran here) or unreadable: nothing to go by
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _pid_in(path) or 0
        fcntl.flock(handle, fcntl.LOCK_UN)
    return None
