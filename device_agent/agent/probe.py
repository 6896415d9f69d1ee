"""Measure what this device can actually do, for the ``hello`` message sent to the coordinator.

The coordinator sizes each device's FedHM rank and round deadline from this profile. Datasheet
numbers are useless for that: the same Jetson runs at a fraction of its peak in a low power mode,
a Raspberry Pi throttles when hot, and a laptop shares its memory with a browser. So the profile
carries measured numbers (available memory now, fp32 matmul throughput now), taken quickly enough
to run at every start on the slowest device in the fleet.

The ``memory`` / ``compute`` / ``network`` sections are the same models the coordinator's static
device profiles (``profiles/``) are made of, so a measured report replaces a datasheet section by
section: whatever the probe measured wins, whatever it could not measure keeps the datasheet value.
"""

from __future__ import annotations

import importlib.metadata
import platform
import socket
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import psutil
import torch

from device_agent.common.profile import ComputeSpec, DeviceProfile, MemorySpec, NetworkSpec

# Square matmul sizes: large enough to reach steady-state throughput, small enough that one
# product (0.27 GFLOP on CPU) takes well under a second even on a Raspberry Pi, so the two
# warm-ups plus the minimum of three timed repeats stay bounded.
_MATMUL_N = {"cpu": 512, "mps": 1024, "cuda": 2048}
_MIN_REPEATS = 3
# Bandwidth test buffers. 16 MiB: a training step's activations (ResNet-18 at batch 32: 1-8 MiB a
# tensor), below glibc's largest mmap threshold (32 MiB) so the output reuses freed memory, as a
# step's tensors do. 64 MiB: above it, every such tensor is a fresh mapping whose pages fault in.
_REUSED_BYTES = 16 * 2**20
_FRESH_BYTES = 64 * 2**20
# The convolution timed for the training efficiency: ResNet-18's second stage at batch 8 (0.6 GFLOP
# forward, three times that per training step: about 20 ms on a 2-core x86 laptop, 0.4 s on a Pi 4).
_CONV_SHAPE = {"batch": 8, "channels": 128, "size": 16}
_VERSIONED_PACKAGES = ("numpy", "paho-mqtt", "pydantic", "safetensors", "psutil", "pyyaml", "fedfleet")


class DeviceUnavailable(ValueError):
    """The accelerator asked for is not on this machine (a user's setting, not a bug)."""


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
        raise DeviceUnavailable(f"unknown device {device!r}; expected auto, cpu, cuda, cuda:N or mps") from None
    if dev.type == "cpu":
        return dev
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailable(f"device {device!r} requested but CUDA is not available on this machine")
        index = torch.cuda.current_device() if dev.index is None else dev.index
        if index >= torch.cuda.device_count():
            raise DeviceUnavailable(
                f"device {device!r} requested but only {torch.cuda.device_count()} CUDA device(s) exist"
            )
        return torch.device("cuda", index)
    if dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise DeviceUnavailable(f"device {device!r} requested but MPS is not available on this machine")
        return dev
    raise DeviceUnavailable(f"unsupported device {device!r}; expected auto, cpu, cuda, cuda:N or mps")


def _synchronizer(dev: torch.device) -> Callable[[], None]:
    """GPU kernels are asynchronous; without a sync the timer would only measure the launch."""
    if dev.type == "cuda":
        return lambda: torch.cuda.synchronize(dev)
    if dev.type == "mps":
        return torch.mps.synchronize
    return lambda: None


def measure_matmul_gflops(
    dev: torch.device, benchmark_seconds: float, clock: Callable[[], float] = time.perf_counter
) -> float:
    """Median fp32 square-matmul throughput in GFLOPS, spending about ``benchmark_seconds``.

    The median of several repeats resists one-off stalls (another process, a frequency change).
    At least three repeats are always timed, so the budget is a target, not a hard limit. The
    matrix size depends only on the device type, never on the budget or on a first timing, so that
    numbers from different devices and different budgets stay comparable. ``clock`` may be
    ``time.process_time`` to time a single-threaded CPU run by the CPU time it got (robust to a
    shared machine); the default wall clock is what a GPU needs.
    """
    if not benchmark_seconds > 0:
        raise ValueError(f"benchmark_seconds must be positive, got {benchmark_seconds}")
    sync = _synchronizer(dev)
    n = _MATMUL_N[dev.type]
    started = clock()
    # A private generator: probing must not shift the global RNG that seeds training.
    gen = torch.Generator().manual_seed(0)

    with torch.inference_mode():
        a = torch.randn(n, n, generator=gen).to(dev)
        b = torch.randn(n, n, generator=gen).to(dev)
        # Two warm-ups: the first pays one-off costs (cuBLAS handles, thread pools, caches),
        # the second estimates the steady-state time of one product.
        torch.matmul(a, b)
        sync()
        t0 = clock()
        torch.matmul(a, b)
        sync()
        one = max(clock() - t0, 1e-9)

        # Batch several products per timed repeat so fast GPUs are not timing launch overhead,
        # aiming at roughly ten repeats within the budget.
        inner = max(1, int(benchmark_seconds / 10 / one))
        per_product: list[float] = []
        while len(per_product) < _MIN_REPEATS or clock() - started < benchmark_seconds:
            t0 = clock()
            for _ in range(inner):
                torch.matmul(a, b)
            sync()
            per_product.append(max(clock() - t0, 1e-9) / inner)

    return 2 * n**3 / statistics.median(per_product) / 1e9


def _timed_median(
    fn: Callable[[], object], sync: Callable[[], None], repeats: int, clock: Callable[[], float]
) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` (synchronized): robust to a one-off stall."""
    times = []
    for _ in range(max(1, repeats)):
        t0 = clock()
        fn()
        sync()
        times.append(max(clock() - t0, 1e-9))
    return statistics.median(times)


def measure_memory_bandwidth_gbs(
    dev: torch.device, repeats: int = 5, clock: Callable[[], float] = time.perf_counter, fresh: bool = False
) -> float:
    """Effective bandwidth, in GB/s, of a training-mode batch norm on a buffer the size of a step's tensors.

    Norms, activations and pooling (and the thin factorized convolutions' data movement) are
    bound by memory traffic, not by matmul throughput. A plain copy overstates what such kernels
    reach on a CPU (they also compute per element), so the probe times the real thing: batch norm
    reads its input twice (statistics, then normalization) and writes once, 3 x the buffer.

    The default times a 16 MiB buffer whose output lands in memory the allocator reuses, as a training
    step's tensors do. ``fresh=True`` times a 64 MiB one instead: on a CPU, glibc maps every block over
    32 MiB afresh, so its pages fault in as it is written (2-3 x slower on a 2-core EPYC): what a step
    whose tensors are that large pays (the cost model prices those operators at this figure).
    """
    sync = _synchronizer(dev)
    size = _FRESH_BYTES if fresh else _REUSED_BYTES
    x = torch.ones(16, 64, 128, size // 4 // (16 * 64 * 128), device=dev)
    with torch.inference_mode():

        def norm() -> None:
            torch.nn.functional.batch_norm(x, None, None, training=True)

        for _ in range(2):  # the second call's output reuses the first's memory (under the mmap threshold)
            norm()
        sync()
        return 3 * size / _timed_median(norm, sync, repeats, clock) / 1e9


def measure_training_efficiency(
    dev: torch.device, matmul_gflops: float, repeats: int = 3, clock: Callable[[], float] = time.perf_counter
) -> float:
    """The rate of a convolution's training step (forward, both gradients) over ``matmul_gflops``.

    What the cost model multiplies the matmul rate by for a training step's convolutions: measured on a
    3 x 3 convolution the size of a small step's layers (ResNet-18's second stage at batch 8) rather than
    assumed, so that nothing needs fitting to timed training steps. It may exceed 1 (convolution kernels
    can beat the probe's 512 x 512 matmul on a CPU).
    """
    sync = _synchronizer(dev)
    batch, channels, size = _CONV_SHAPE["batch"], _CONV_SHAPE["channels"], _CONV_SHAPE["size"]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, channels, size, size, generator=gen).to(dev).requires_grad_()
    weight = torch.randn(channels, channels, 3, 3, generator=gen).to(dev).requires_grad_()

    def step() -> None:
        y = torch.nn.functional.conv2d(x, weight, padding=1)
        y.backward(torch.ones_like(y))

    step()
    sync()
    flops = 3 * 2 * batch * channels * size * size * channels * 9
    ratio = flops / _timed_median(step, sync, repeats, clock) / 1e9 / matmul_gflops
    # On a loaded host either timing can be cut short by the scheduler (ratios of 5-10 seen at load 18-20): kept to
    # the range the profile accepts, so a busy machine's probe still yields a profile instead of failing the agent.
    field = ComputeSpec.model_fields["training_efficiency"]
    low, high = (next(m for m in field.metadata if hasattr(m, attr)) for attr in ("ge", "le"))
    return min(max(ratio, low.ge), high.le)


def measure_broker_link(url: str, payload_bytes: int = 1 << 20, timeout: float = 10.0) -> NetworkSpec:
    """Latency and throughput to an MQTT broker, from publish/echo round trips on a scratch topic.

    The device subscribes to a topic of its own and publishes to it, so each message travels up
    to the broker and back: a small message gives the latency (half its round trip), a large one
    the throughput (both legs of its extra time). Up and down are therefore the same estimate.
    ``url`` is mqtt://[user:password@]host[:port] or mqtts://...; nothing is retained or persisted.
    """
    import paho.mqtt.client as mqtt

    parts = urlsplit(url)
    if parts.scheme not in {"mqtt", "mqtts"} or not parts.hostname:
        raise ValueError(f"broker URL must look like mqtt://host:port or mqtts://host:port, got {url!r}")
    port = parts.port or (8883 if parts.scheme == "mqtts" else 1883)
    topic = f"fedfleet/probe/{uuid.uuid4().hex}"
    arrived = threading.Event()
    subscribed = threading.Event()
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"probe-{uuid.uuid4().hex[:12]}")
    if parts.username:
        client.username_pw_set(parts.username, parts.password)
    if parts.scheme == "mqtts":
        client.tls_set()

    def on_subscribe(*_args: Any) -> None:
        subscribed.set()

    def on_message(*_args: Any) -> None:
        arrived.set()

    client.on_subscribe = on_subscribe
    client.on_message = on_message

    def round_trip(size: int) -> float:
        arrived.clear()
        t0 = time.perf_counter()
        client.publish(topic, b"\0" * size, qos=0)
        if not arrived.wait(timeout):
            raise TimeoutError(f"no echo from broker {parts.hostname}:{port} within {timeout} s")
        return time.perf_counter() - t0

    try:
        client.connect(parts.hostname, port, keepalive=30)
    except OSError as exc:
        raise ValueError(f"cannot reach broker {parts.hostname}:{port}: {exc}") from None
    client.loop_start()
    try:
        client.subscribe(topic, qos=0)
        if not subscribed.wait(timeout):
            raise TimeoutError(f"broker {parts.hostname}:{port} did not acknowledge a subscription within {timeout} s")
        round_trip(16)
        small = statistics.median(round_trip(16) for _ in range(5))
        large = statistics.median(round_trip(payload_bytes) for _ in range(3))
    finally:
        client.loop_stop()
        client.disconnect()
    mbps = 2 * payload_bytes * 8 / max(large - small, 1e-6) / 1e6
    return NetworkSpec(downlink_mbps=mbps, uplink_mbps=mbps, latency_ms=small / 2 * 1e3)


def _accelerator_details(dev: torch.device) -> tuple[str | None, int | None]:
    """Name and total memory of the accelerator; the coordinator uses memory to cap model size."""
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        return props.name, int(props.total_memory)
    # MPS shares system memory (already reported) and exposes no device name; CPU is described by
    # platform/machine/cpu_count.
    return None, None


def _memory_section(dev: torch.device, system: Any, accel_memory: int | None) -> MemorySpec:
    """What training may use: dedicated GPU memory free now, or system memory available now."""
    if dev.type == "cuda" and accel_memory is not None:
        free, _ = torch.cuda.mem_get_info(dev)
        # Jetsons report their unified system memory as CUDA memory: the OS competes for it.
        shared = bool(getattr(torch.cuda.get_device_properties(dev), "is_integrated", False))
        available = min(free, int(system.available)) if shared else free
        return MemorySpec(total=accel_memory, shared=shared, reserved=max(0, accel_memory - available))
    return MemorySpec(total=int(system.total), shared=True, reserved=int(system.total) - int(system.available))


def _versions(dev: torch.device) -> dict[str, str]:
    versions = {}
    for package in _VERSIONED_PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    if dev.type == "cuda" and torch.version.cuda:
        versions["cuda"] = torch.version.cuda
    return versions


def probe_device(
    benchmark_seconds: float = 0.5,
    device: str | None = None,
    broker_url: str | None = None,
    compute: ComputeSpec | None = None,
) -> DeviceProfile:
    """Profile this device as it is right now, for the coordinator's planning.

    ``device`` is ``None``/``"auto"`` to pick the best available, or an explicit ``"cpu"``,
    ``"cuda"``, ``"cuda:N"`` or ``"mps"``; an unavailable explicit device raises ``ValueError``.
    ``broker_url`` adds a measured ``network`` section (see :func:`measure_broker_link`). ``compute``: the
    section to report instead of measuring one (an emulated device's, which replaces the measured one anyway:
    the benchmarks cost a worker ~1.7 CPU-s on a 2-core EPYC for numbers it would throw away).
    """
    dev = resolve_device(device)
    memory = psutil.virtual_memory()
    name, accel_memory = _accelerator_details(dev)
    if compute is None:
        gflops = measure_matmul_gflops(dev, benchmark_seconds)
        compute = ComputeSpec(
            fp32_gflops=gflops,
            memory_bandwidth_gbs=measure_memory_bandwidth_gbs(dev),
            fresh_memory_bandwidth_gbs=measure_memory_bandwidth_gbs(dev, fresh=True) if dev.type == "cpu" else None,
            # A GPU's small convolution is launch-bound, not a rate the planner should scale a step by: CPU only.
            training_efficiency=measure_training_efficiency(dev, gflops) if dev.type == "cpu" else None,
        )
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
        matmul_gflops=compute.fp32_gflops,
        memory=_memory_section(dev, memory, accel_memory),
        compute=compute,
        network=None if broker_url is None else measure_broker_link(broker_url),
        versions=_versions(dev),
    )
