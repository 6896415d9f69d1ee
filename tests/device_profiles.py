"""What a device reports about itself in its hello, for tests that need one (a 4 GB Pi by default)."""

from __future__ import annotations

from typing import Any

from device_agent.common.profile import DeviceProfile

GIB = 1024**3


# The fields as they travel in a hello (what the fuzz tests start from and mutate).
REPORTED_FIELDS: dict[str, Any] = {
    "hostname": "pi",
    "platform": "Linux",
    "machine": "aarch64",
    "python": "3.11",
    "torch": "2.13",
    "cpu_count": 4,
    "memory_total_bytes": 4 * GIB,
    "memory_available_bytes": 2 * GIB,
    "accelerator": "cpu",
    "accelerator_name": None,
    "accelerator_memory_bytes": None,
    "matmul_gflops": 5.0,
}


def reported_profile(**changes: Any) -> DeviceProfile:
    """A device's self-report; ``changes`` override fields (e.g. ``matmul_gflops=4.8``)."""
    return DeviceProfile(**(REPORTED_FIELDS | changes))
