"""Measure what this device can actually do, for the ``hello`` message sent to the coordinator.

The coordinator sizes each device's FedHM rank and round deadline from this profile. Datasheet
numbers are useless for that: the same Jetson runs at a fraction of its peak in a low power mode,
a Raspberry Pi throttles when hot, and a laptop shares its memory with a browser. So the profile
carries measured numbers (available memory now, fp32 matmul throughput now), taken quickly enough
to run at every start on the slowest device in the fleet.
"""

from __future__ import annotations

import platform
import socket
import statistics
import time
from collections.abc import Callable

import psutil
import torch
from pydantic import BaseModel

# Square matmul sizes: large enough to reach steady-state throughput, small enough that one
# product (0.27 GFLOP on CPU) takes well under a second even on a Raspberry Pi, so the two
# warm-ups plus the minimum of three timed repeats stay bounded.
_MATMUL_N = {"cpu": 512, "mps": 1024, "cuda": 2048}
_MIN_REPEATS = 3


class DeviceProfile(BaseModel):
    """One device as the coordinator sees it; field names are part of the wire protocol."""

    protocol_version: int = 1
    hostname: str
    platform: str
    machine: str
    python: str
    torch: str
    cpu_count: int
    memory_total_bytes: int
    memory_available_bytes: int
    accelerator: str
    accelerator_name: str | None
    accelerator_memory_bytes: int | None
    matmul_gflops: float


def resolve_device(device: str | None = None) -> torch.device:
    """Pick the device the agent will train on, failing loudly rather than falling back.

    ``None`` or ``"auto"`` prefers cuda, then mps, then cpu. An explicit request for a device this
    machine does not have is an error: silently training on the CPU instead would make the
    coordinator plan with the wrong numbers.
    """
    if device is None or device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")

    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"unknown device {device!r}; expected auto, cpu, cuda, cuda:N or mps") from None
    if dev.type == "cpu":
        return dev
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but CUDA is not available on this machine")
        index = torch.cuda.current_device() if dev.index is None else dev.index
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r} requested but only {torch.cuda.device_count()} CUDA device(s) exist")
        return torch.device("cuda", index)
    if dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"device {device!r} requested but MPS is not available on this machine")
        return dev
    raise ValueError(f"unsupported device {device!r}; expected auto, cpu, cuda, cuda:N or mps")


def _synchronizer(dev: torch.device) -> Callable[[], None]:
    """GPU kernels are asynchronous; without a sync the timer would only measure the launch."""
    if dev.type == "cuda":
        return lambda: torch.cuda.synchronize(dev)
    if dev.type == "mps":
        return torch.mps.synchronize
    return lambda: None


def measure_matmul_gflops(dev: torch.device, benchmark_seconds: float) -> float:
    """Median fp32 square-matmul throughput in GFLOPS, spending about ``benchmark_seconds``.

    The median of several repeats resists one-off stalls (another process, a frequency change).
    At least three repeats are always timed, so the budget is a target, not a hard limit. The
    matrix size depends only on the device type, never on the budget or on a first timing, so that
    numbers from different devices and different budgets stay comparable.
    """
    if not benchmark_seconds > 0:
        raise ValueError(f"benchmark_seconds must be positive, got {benchmark_seconds}")
    sync = _synchronizer(dev)
    n = _MATMUL_N[dev.type]
    started = time.perf_counter()
    # A private generator: probing must not shift the global RNG that seeds training.
    gen = torch.Generator().manual_seed(0)

    with torch.inference_mode():
        a = torch.randn(n, n, generator=gen).to(dev)
        b = torch.randn(n, n, generator=gen).to(dev)
        # Two warm-ups: the first pays one-off costs (cuBLAS handles, thread pools, caches),
        # the second estimates the steady-state time of one product.
        torch.matmul(a, b)
        sync()
        t0 = time.perf_counter()
        torch.matmul(a, b)
        sync()
        one = max(time.perf_counter() - t0, 1e-9)

        # Batch several products per timed repeat so fast GPUs are not timing launch overhead,
        # aiming at roughly ten repeats within the budget.
        inner = max(1, int(benchmark_seconds / 10 / one))
        per_product: list[float] = []
        while len(per_product) < _MIN_REPEATS or time.perf_counter() - started < benchmark_seconds:
            t0 = time.perf_counter()
            for _ in range(inner):
                torch.matmul(a, b)
            sync()
            per_product.append(max(time.perf_counter() - t0, 1e-9) / inner)

    return 2 * n**3 / statistics.median(per_product) / 1e9


def _accelerator_details(dev: torch.device) -> tuple[str | None, int | None]:
    """Name and total memory of the accelerator; the coordinator uses memory to cap model size."""
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        return props.name, int(props.total_memory)
    # MPS shares system memory (already reported) and exposes no device name; CPU is described by
    # platform/machine/cpu_count.
    return None, None


def probe_device(benchmark_seconds: float = 0.5, device: str | None = None) -> DeviceProfile:
    """Profile this device as it is right now, for the coordinator's planning.

    ``device`` is ``None``/``"auto"`` to pick the best available, or an explicit ``"cpu"``,
    ``"cuda"``, ``"cuda:N"`` or ``"mps"``; an unavailable explicit device raises ``ValueError``.
    """
    dev = resolve_device(device)
    memory = psutil.virtual_memory()
    name, accel_memory = _accelerator_details(dev)
    return DeviceProfile(
        hostname=socket.gethostname(),
        platform=f"{platform.system()}-{platform.release()}-{platform.machine()}",
        machine=platform.machine(),
        python=platform.python_version(),
        torch=torch.__version__,
        cpu_count=psutil.cpu_count(logical=True) or 1,
        memory_total_bytes=int(memory.total),
        memory_available_bytes=int(memory.available),
        accelerator=dev.type,
        accelerator_name=name,
        accelerator_memory_bytes=accel_memory,
        matmul_gflops=measure_matmul_gflops(dev, benchmark_seconds),
    )
