"""What a benchmark ran on, recorded next to its figures: a figure without its machine cannot be compared."""

from __future__ import annotations

import os
import platform
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


def describe() -> dict[str, Any]:
    """CPU model, cores, RAM, torch version and GPU (None without CUDA)."""
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()}",
    }
