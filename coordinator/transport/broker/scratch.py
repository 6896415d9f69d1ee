"""Scratch folders of managed brokers in the system temp folder.

They hold password hashes, ACLs and logs, so none may outlive its coordinator: each is removed when
its process exits, and one left by a killed process (kill -9 skips every exit hook) is swept by the
next start, which can tell from the owner file that its process is gone.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

from coordinator.transport.broker.pidfile import identity, live_owner

OWNER_FILE = ".fedfleet-owner"
PATTERN = "fedfleet-*broker-*"


def scratch_dir(prefix: str) -> Path:
    """A fresh folder in the temp folder that the ``mosquitto`` user can enter, removed when we exit."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    os.chmod(path, 0o711)
    (path / OWNER_FILE).write_text(identity(os.getpid()))
    atexit.register(shutil.rmtree, path, True)
    return path


def sweep_stale(root: Path | None = None) -> list[Path]:
    """Remove scratch folders whose owner process is gone; folders without an owner file are left alone."""
    removed = []
    for folder in Path(root or tempfile.gettempdir()).glob(PATTERN):
        if not (folder / OWNER_FILE).is_file() or live_owner(folder / OWNER_FILE) is not None:
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed
