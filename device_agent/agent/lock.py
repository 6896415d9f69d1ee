"""One agent per device on this machine, and a way for ``doctor`` to tell that it is running.

A fedfleet broker uses the login as the MQTT client id (``use_username_as_clientid``: one device's
login can never take over another's connection), so a second connection with the device's login (a
second agent, or ``doctor``'s login check) takes over the running agent's session and disconnects it.
``device-agent run`` therefore holds, while it runs:

- an exclusive ``flock`` on ``STATE_DIR/agent.lock`` with its pid inside;
- on Linux, an abstract Unix socket named after the broker, fleet and device (:func:`device_key`):
  machine-wide, whatever the state dir, the user or a service's private /tmp, so a second unpacked copy
  of the same kit is caught too.

The kernel drops both when the process ends, however it ends, so nothing stale blocks a restart.
An agent on another machine with the same login is beyond both; only the broker knows of it.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import socket
import sys
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


def device_key(host: str, port: int, fleet: str, device: str) -> str:
    """What two agents must not share on one machine: one login on one broker."""
    return f"{host}:{port}/{fleet}/{device}"


def _address(key: str) -> str:
    # Abstract names (a leading NUL) live outside the file system: no file to clean up, any user sees them.
    return "\0fedfleet-agent-" + hashlib.sha256(key.encode()).hexdigest()[:40]


def claim_device(key: str, state_dir: Path) -> socket.socket | None:
    """Claim ``key`` on this machine for as long as the returned socket stays open (None where unsupported).

    Raises :class:`AlreadyRunning` when an agent with the same login on the same broker already runs here.
    """
    if not sys.platform.startswith("linux"):
        return None
    claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        claim.bind(_address(key))
    except OSError:
        claim.close()
        raise AlreadyRunning(
            f"another device agent for {key} is running on this machine (another copy of the kit, or another "
            f"state dir than {state_dir}): two agents with one login take over each other's broker session; "
            "stop the other one"
        ) from None
    return claim


def device_running_here(key: str) -> bool:
    """Whether an agent holds ``key``'s claim on this machine (always False where claims are unsupported)."""
    try:
        probe = claim_device(key, Path())
    except AlreadyRunning:
        return True
    if probe is not None:
        probe.close()
    return False
