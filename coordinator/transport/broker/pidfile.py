"""Which process a pid file names, told apart from a later process that reused its pid."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from device_agent.common.atomic import atomic_write


def identity(pid: int) -> str:
    """``pid start-time`` of a live process ("" if it is gone); on systems without /proc just the pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return str(pid) if _alive(pid) else ""
    return f"{pid} {stat.rsplit(')', 1)[1].split()[19]}"


def record(path: Path, pid: int) -> None:
    atomic_write(path, (identity(pid) + "\n").encode())


def live_owner(path: Path) -> int | None:
    """The pid ``path`` names if that very process still runs, else None (no file, or a dead/reused pid)."""
    try:
        written = path.read_text().strip()
    except OSError:
        return None
    pid = written.split()[0] if written else ""
    if not pid.isdigit() or identity(int(pid)) != written:
        return None
    return int(pid)


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def end(pid: int, timeout: float = 10.0) -> None:
    """SIGTERM (a broker saves its persistence on it), then SIGKILL if it lingers; not our child, so poll."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not _alive(pid):
                return
            time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    state = Path(f"/proc/{pid}/stat")
    try:
        return state.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True
