"""What a benchmark ran on, recorded next to its figures: a figure without its machine cannot be compared."""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import psutil
import torch


def cpu_model() -> str:
    """The CPU's marketing name (Linux /proc/cpuinfo), else what the platform module knows."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


REPO = Path(__file__).resolve().parents[1]


def source() -> dict[str, Any]:
    """The commit the figures come from, whether the checkout had uncommitted changes (None outside git) and
    the SHA-256 of those changes (``git diff HEAD``): a figure of a dirty tree or of another commit is not the
    code at that commit."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30)
        except OSError:
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    dirty = None if commit is None or status is None else bool(status)
    # Two dirty trees at one commit are two versions of the code: the hash of the uncommitted changes tells them apart.
    changes = git("diff", "HEAD") if dirty else None
    digest = None if changes is None else hashlib.sha256(changes.encode()).hexdigest()
    return {"commit": commit, "dirty": dirty, "changes_sha256": digest}


def describe() -> dict[str, Any]:
    """Commit (and dirty flag), CPU model, cores, RAM, torch version and GPU (None without CUDA)."""
    return {
        **source(),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()}",
    }
