"""A device's compute speed that one busy moment cannot sink: repeated, median, remembered across restarts.

One 0.2 s matmul benchmark at start-up reads whatever else the machine is doing at that moment:
agents started together on one host, a browser, a package update. The coordinator plans every
round from this number, so a bad reading can exclude a device for the whole run. The agent
therefore times several short benchmarks, keeps the medians of its last starts in its state
directory (per machine, accelerator and torch version) and reports the median of that history.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from device_agent.agent.probe import measure_matmul_gflops, probe_device, resolve_device
from device_agent.common.atomic import atomic_write
from device_agent.common.profile import ComputeSpec, DeviceProfile

SPEED_FILE = "speed.json"
REPEATS = 3
KEPT_STARTS = 5


def identity(profile: DeviceProfile) -> dict[str, str | None]:
    """What a cached speed belongs to: another accelerator or torch build measures something else."""
    return {
        "hostname": profile.hostname,
        "accelerator": profile.accelerator,
        "accelerator_name": profile.accelerator_name,
        "torch": profile.torch,
    }


def steady_gflops(samples: list[float], who: dict[str, str | None], state_dir: Path) -> float:
    """The (upper) median of the last starts' medians, this start's (the median of ``samples``) included."""
    history = [*_remembered(state_dir / SPEED_FILE, who), statistics.median(samples)][-KEPT_STARTS:]
    atomic_write(state_dir / SPEED_FILE, json.dumps({"identity": who, "gflops": history}).encode())
    # The upper median: contention only ever slows a benchmark, so of two starts the faster one is the device.
    return statistics.median_high(history)


def measured_profile(device_type: str, state_dir: Path, seconds: float = 0.2) -> DeviceProfile:
    """This device's profile at start-up, its fp32 throughput taken ``REPEATS`` times and steadied by history."""
    profile = probe_device(seconds, device_type)
    dev = resolve_device(device_type)
    samples = [profile.compute.fp32_gflops, *(measure_matmul_gflops(dev, seconds) for _ in range(REPEATS - 1))]
    gflops = steady_gflops(samples, identity(profile), state_dir)
    compute = ComputeSpec.model_validate({**profile.compute.model_dump(), "fp32_gflops": gflops})
    return profile.model_copy(update={"matmul_gflops": gflops, "compute": compute})


def _remembered(path: Path, who: dict[str, str | None]) -> list[float]:
    """Earlier medians for the same identity; a missing, foreign or damaged file is no history."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(raw, dict) or raw.get("identity") != who or not isinstance(raw.get("gflops"), list):
        return []
    return [float(g) for g in raw["gflops"] if isinstance(g, int | float) and g > 0]
