"""Hold an emulated agent process to a device profile: threads, memory, compute speed.

The emulator runs one real agent process per emulated device, and each must behave like its device
where planning depends on it: it must fail when it outgrows the device's memory, and a training
step must take as long as on the device. By default that is device time: each step lasts the
seconds the coordinator's cost model predicts for the profile at the level trained (sleeping the
difference, never speeding up), so a round takes as long as on the real device whatever the host.
The older host ratio (stretch each step by host GFLOPS / profile GFLOPS) stays as an option; it is
wrong wherever the host step is launch- or memory-bound (x40-x215 on an H100 for the demo CNN).
Everything here takes plain numbers (threads, bytes, seconds, a factor), so the agent never needs
the profiles package; bandwidth shaping is in
:mod:`device_agent.emulation.shaping`. :class:`EmulatedDevice` applies them all to one process and hands the
runtime the hooks (:mod:`device_agent.agent.hooks`) through which it is held to them.

CPU memory is capped with ``RLIMIT_AS`` (address space), not an RSS watchdog:

- the kernel refuses the allocation itself, so the agent gets an exception at the allocating line,
  as it would on a device that ran out of memory, and can report "failed: out of memory";
- a watchdog samples RSS every few milliseconds, and a single large tensor can overshoot the cap
  between two samples far enough to push the shared host into its OOM killer, which may then kill
  another emulated device or the coordinator;
- it costs nothing while training and is inherited by child processes (data loader workers).

The price is that address space counts reservations that are not resident (thread stacks, malloc
arenas), a few tens of MB: the cap is set to what the process has mapped when it is applied plus
the budget, so apply it after importing torch and before building the model. It cannot be used
once CUDA is initialized (the driver reserves terabytes of address space); on a GPU the cap is
``torch.cuda.set_per_process_memory_fraction`` on device memory instead.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TypeVar

import torch

from device_agent.agent.config import EmulationConfig
from device_agent.agent.hooks import RuntimeHooks
from device_agent.common.profile import DeviceProfile, NetworkSpec
from device_agent.emulation.accounting import MemoryAccount, MemoryCapExceeded
from device_agent.emulation.batching import StepBatcher
from device_agent.emulation.shaping import TokenBucket
from device_agent.emulation.slots import ComputeSlots
from device_agent.training.batched import DeviceTrainer, StepRunner
from device_agent.training.oom import is_out_of_memory

T = TypeVar("T")

_THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def thread_env(threads: int) -> dict[str, str]:
    """Environment for launching an agent with ``threads`` compute threads (OpenMP reads it at start-up)."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    return dict.fromkeys(_THREAD_VARIABLES, str(threads))


def limit_threads(threads: int) -> None:
    """Use at most ``threads`` threads for torch operators, as a device with that many cores would."""
    os.environ.update(thread_env(threads))
    torch.set_num_threads(threads)
    # Inter-op threads are only settable before the first parallel op; intra-op threads are what training uses.
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(threads)


@dataclass(frozen=True)
class MemoryCap:
    """An applied memory cap; :meth:`guard` turns allocation failures into :class:`MemoryCapExceeded`."""

    kind: str
    budget_bytes: int

    @contextmanager
    def guard(self) -> Iterator[None]:
        try:
            yield
        except MemoryCapExceeded:
            raise
        except (MemoryError, RuntimeError) as exc:
            if not is_out_of_memory(exc):
                raise
            text = str(exc).strip()
            first = text.splitlines()[0] if text else type(exc).__name__
            raise MemoryCapExceeded(
                f"emulated device memory cap exceeded: the profile allows {self.budget_bytes / 2**20:.0f} MiB "
                f"({self.kind}); {first}"
            ) from exc


def _mapped_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def cap_cpu_memory(budget_bytes: int) -> MemoryCap:
    """Let this process map at most ``budget_bytes`` more than it has mapped now (RLIMIT_AS, Linux)."""
    if not sys.platform.startswith("linux"):
        raise RuntimeError(f"CPU memory caps use RLIMIT_AS and /proc, which need Linux (this is {sys.platform})")
    import resource

    if budget_bytes <= 0:
        raise ValueError(f"memory budget must be positive, got {budget_bytes}")
    if torch.cuda.is_initialized():
        raise RuntimeError("RLIMIT_AS cannot cap a process that has initialized CUDA; use cap_cuda_memory")
    limit = _mapped_bytes() + int(budget_bytes)
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY and limit > hard:
        raise ValueError(f"memory budget needs an address-space limit of {limit} bytes, above the hard limit {hard}")
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    return MemoryCap("address-space limit, RLIMIT_AS", int(budget_bytes))


def cap_cuda_memory(limit_bytes: int, device: torch.device | str | int = "cuda") -> MemoryCap:
    """Cap torch's caching allocator on ``device`` at ``limit_bytes`` of device memory."""
    if limit_bytes <= 0:
        raise ValueError(f"memory limit must be positive, got {limit_bytes}")
    device = torch.device(device)
    # set_per_process_memory_fraction wants an index: a bare "cuda" is a ValueError (torch 2.11).
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    if limit_bytes > total:
        raise ValueError(f"memory limit {limit_bytes} bytes exceeds the {total} bytes of {device}")
    torch.cuda.set_per_process_memory_fraction(limit_bytes / total, index)
    return MemoryCap(f"CUDA memory fraction {limit_bytes / total:.4f} of {device}", int(limit_bytes))


def slowdown_factor(host_gflops: float, profile_gflops: float) -> float:
    """How many times slower than this host an emulated device must run: host / profile, never below 1.

    Measure ``host_gflops`` with the thread count the agent will use (``device-agent probe`` after
    :func:`limit_threads`): the emulated device's speed is relative to what the agent process gets.
    A device faster than the host cannot be emulated faster; it runs at host speed (factor 1).
    """
    for name, value in (("host_gflops", host_gflops), ("profile_gflops", profile_gflops)):
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{name} must be a positive number, got {value}")
    return max(1.0, host_gflops / profile_gflops)


class Throttle:
    """Hold compute to a device's pace with duty-cycle sleeps: a step time, or ``factor`` x the host's.

    After each step of measured duration t the agent owes idle time: ``step_seconds`` - t when a step
    time is set (device time: the cost model's prediction for the profile; a host slower than that
    owes nothing, it is never sped up), else (factor - 1) x t (host ratio). The debt is
    slept off once it reaches ``min_sleep`` and oversleeping is credited to the next steps. Sleeping
    after every step would overshoot: the step after a sleep runs on cold caches and measures slower,
    and that inflation is multiplied too (x2 came out as x3 on the 2-core CI host); sleeping every
    50 ms amortizes it. Sleeping, unlike busy work, leaves the shared cores to the other
    emulated devices, so a slowed device does not slow the rest. Pass ``sync`` on a GPU so t covers
    the kernels, not their launch. A step time absorbs that inflation too: a slower step owes less.
    ``step_seconds`` may be changed between rounds (it depends on the level trained). ``hold`` (a
    worker's compute slot, :mod:`device_agent.emulation.worker`) is held while computing and released before
    sleeping, so while one virtual device sleeps off its device time another one trains.
    """

    def __init__(
        self,
        factor: float = 1.0,
        *,
        step_seconds: float | None = None,
        sync: Callable[[], None] | None = None,
        hold: AbstractContextManager[object] | None = None,
        min_sleep: float = 0.05,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not (factor >= 1 and math.isfinite(factor)):
            raise ValueError(f"slowdown factor must be a finite number >= 1, got {factor}")
        if step_seconds is not None and not (step_seconds > 0 and math.isfinite(step_seconds)):
            raise ValueError(f"step_seconds must be a positive number, got {step_seconds}")
        self.factor = factor
        self.step_seconds = step_seconds
        self._sync = sync or (lambda: None)
        self._hold = hold or nullcontext()
        self._min_sleep = min_sleep
        self._clock = clock
        self._sleep = sleep
        self._debt = 0.0
        self.busy_seconds = 0.0
        self.slept_seconds = 0.0

    @contextmanager
    def step(self, hold: bool = True) -> Iterator[None]:
        """Wrap one training step (forward, backward, optimizer step); the sleep comes after ``hold`` is released.

        ``hold=False``: the step waits for its slot itself (a worker's batcher), and that wait counts as the step's.
        """
        with self._hold if hold else nullcontext():
            self._sync()
            start = self._clock()
            yield
            self._sync()
            elapsed = self._clock() - start
        self.busy_seconds += elapsed
        self._debt += self.owed(elapsed)
        if self._debt >= self._min_sleep:
            self.flush()

    def owed(self, elapsed: float) -> float:
        """Idle seconds one step of ``elapsed`` host seconds owes (never negative)."""
        if self.step_seconds is not None:
            return max(0.0, self.step_seconds - elapsed)
        return (self.factor - 1) * elapsed

    def flush(self) -> None:
        """Sleep off the remaining debt, e.g. at the end of local training before uploading."""
        if self._debt <= 0:
            return
        start = self._clock()
        self._sleep(self._debt)
        slept = self._clock() - start
        self.slept_seconds += slept
        self._debt -= slept


def step_seconds_at(table: Mapping[float, float], level: float) -> float:
    """The step time of ``level`` in an ``emulation.step_seconds`` table (levels compared as floats, to 1e-9)."""
    for key, seconds in table.items():
        if math.isclose(key, level, rel_tol=1e-9):
            return seconds
    known = ", ".join(f"{key:g}" for key in sorted(table))
    raise ValueError(f"emulation.step_seconds has no step time for level {level:g} (it has {known})")


class EmulatedDevice(RuntimeHooks):
    """Runtime hooks that hold this process to an ``emulation:`` block: threads, memory, speed, links.

    Constructing it applies the process-wide limits (threads, the memory cap), so build it once, at
    agent start-up, after importing torch and before building any model. The parts stay inspectable:
    ``memory``, ``throttle``, ``uplink`` and ``downlink`` are None where the block sets no limit.
    """

    def __init__(
        self,
        emulation: EmulationConfig,
        device: torch.device,
        compute_slot: ComputeSlots | None = None,
        batcher: StepBatcher | None = None,
    ) -> None:
        """``compute_slot``: this device shares its process with others (a worker); see
        :mod:`device_agent.emulation.worker`. It waits for a slot with the time its round's training
        started, so the worker's devices finish one after another (:mod:`device_agent.emulation.slots`).

        Alone in its process, the device gets the process-wide caps (threads, RLIMIT_AS or a CUDA memory
        fraction). Sharing one, it gets none of them: its memory is held by accounting alone and its
        steps take turns in ``compute_slot``. ``batcher`` (a worker's, over the same slots): its training steps
        may run together with other devices' (:mod:`device_agent.emulation.batching`); then a step's measured
        time includes its wait for the slot, and on CUDA the batched step's memory peak is not checked against
        this device's budget (it is K devices'; the predicted peak still is).
        """
        self.emulation = emulation
        self.memory: MemoryCap | None = None
        if compute_slot is None:
            if emulation.threads is not None:
                limit_threads(emulation.threads)
            if emulation.memory_bytes is not None:
                self.memory = (
                    cap_cuda_memory(emulation.memory_bytes, device)
                    if device.type == "cuda"
                    else cap_cpu_memory(emulation.memory_bytes)
                )
        self.account = (
            None
            if emulation.memory_bytes is None
            else MemoryAccount(emulation.memory_bytes, emulation.peak_bytes, device, shared=compute_slot is not None)
        )
        self._started = 0.0
        self._slot = None if compute_slot is None else compute_slot.turn(lambda: self._started)
        self._batcher = batcher
        # A throttle on a GPU must time the kernels, not their asynchronous launch.
        sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
        paced = emulation.slowdown > 1 or emulation.step_seconds is not None
        self.throttle = Throttle(emulation.slowdown, sync=sync, hold=self._slot) if paced else None
        self._slept_before = 0.0
        up, down = emulation.uplink_bytes_per_s, emulation.downlink_bytes_per_s
        self.uplink = TokenBucket(up, latency_s=emulation.latency_s) if up else None
        self.downlink = TokenBucket(down, latency_s=emulation.latency_s) if down else None

    def profile(self, measured: DeviceProfile) -> DeviceProfile:
        """The host as measured, then held to the emulation: what the coordinator should plan with."""
        emulation = self.emulation
        data = measured.model_dump()
        if emulation.compute is not None:  # device time: the planner predicts with what paces the steps
            data["compute"] = emulation.compute.model_dump()
            data["matmul_gflops"] = emulation.compute.fp32_gflops
        else:
            gflops = measured.compute.fp32_gflops / emulation.slowdown
            data["matmul_gflops"] = gflops
            data["compute"]["fp32_gflops"] = gflops
        if emulation.memory_bytes is not None:
            data["memory"] = {"total": emulation.memory_bytes, "shared": measured.memory.shared, "reserved": 0}
        if emulation.uplink_bytes_per_s and emulation.downlink_bytes_per_s:
            data["network"] = NetworkSpec(
                uplink_mbps=emulation.uplink_bytes_per_s * 8 / 1e6,
                downlink_mbps=emulation.downlink_bytes_per_s * 8 / 1e6,
                latency_ms=emulation.latency_s * 1000,
            ).model_dump()
        return DeviceProfile.model_validate(data)

    def memory_guard(self) -> AbstractContextManager[object]:
        return self.memory.guard() if self.memory is not None else nullcontext()

    def before_training(self, level: float) -> None:
        """Check ``level``'s predicted memory, set its step time (device time), start counting this round's sleeps."""
        self._started = time.monotonic()
        if self.account is not None:
            self.account.start(level)
        if self.throttle is None:
            return
        self._slept_before = self.throttle.slept_seconds
        table = self.emulation.step_seconds
        if table is not None:
            self.throttle.step_seconds = step_seconds_at(table, level)

    @contextmanager
    def step(self) -> Iterator[None]:
        # Step by step, so the slowed device computes at its pace instead of bursting then idling.
        paced = self.throttle.step() if self.throttle is not None else (self._slot or nullcontext())
        measured = self.account.measure() if self.account is not None else nullcontext()
        with paced, measured:
            yield

    def step_batcher(self) -> StepRunner | None:
        return None if self._batcher is None else self._batched_step

    def _batched_step(self, trainer: DeviceTrainer, step: int) -> float:
        assert self._batcher is not None
        paced = self.throttle.step(hold=False) if self.throttle is not None else nullcontext()
        with paced:
            return self._batcher.step(trainer, step, self._started)

    def compute(self) -> AbstractContextManager[object]:
        # Unpaced (evaluation is not in the cost model's step time), but in turn with the worker's other devices.
        return self._slot or nullcontext()

    def run_compute(self, work: Callable[[], T]) -> T:
        # Inside step()/compute(), so this device holds a turn; a packed GPU worker runs it on the turn's thread.
        return work() if self._slot is None else self._slot.run(work)

    def after_training(self) -> float:
        """Sleep off the slowdown still owed; the sleep is training time, as on the slow device."""
        if self.throttle is None:
            return 0.0
        slept = self.throttle.slept_seconds
        self.throttle.flush()
        return self.throttle.slept_seconds - slept

    def held_seconds(self) -> float:
        return 0.0 if self.throttle is None else self.throttle.slept_seconds - self._slept_before

    def before_upload(self) -> None:
        if self.uplink is not None:
            self.uplink.wait_latency()

    # Chunk by chunk: a whole payload paid for at once would burst at loopback speed, then stall.
    def before_chunk_out(self, nbytes: int) -> None:
        if self.uplink is not None:
            self.uplink.consume(nbytes)

    def after_chunk_in(self, nbytes: int) -> None:
        if self.downlink is not None:
            self.downlink.consume(nbytes)


def runtime_hooks(emulation: EmulationConfig | None, device: torch.device) -> RuntimeHooks:
    """The hooks an agent.yaml asks for: an :class:`EmulatedDevice` with an ``emulation:`` block, else none."""
    return RuntimeHooks() if emulation is None else EmulatedDevice(emulation, device)
