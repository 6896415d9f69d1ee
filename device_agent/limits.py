"""Hold an emulated agent process to a device profile: threads, memory, compute speed.

The emulator runs one real agent process per emulated device, and each must behave like its device
where planning depends on it: it must fail when it outgrows the device's memory, and it must be as
slow, relative to the others, as its profile says. Everything here takes plain numbers (threads,
bytes, a factor), so the agent never needs the profiles package; bandwidth shaping is in
:mod:`device_agent.shaping`.

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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

_THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


class MemoryCapExceeded(MemoryError):
    """The emulated device ran out of memory: the agent reports it as a failed round, as a device would."""


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
            # torch reports CPU allocation failure as a RuntimeError, CUDA as torch.OutOfMemoryError.
            text = str(exc)
            if not (
                isinstance(exc, (MemoryError, torch.OutOfMemoryError))
                or "can't allocate memory" in text
                or "not enough memory" in text
            ):
                raise
            first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
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
    total = torch.cuda.get_device_properties(device).total_memory
    if limit_bytes > total:
        raise ValueError(f"memory limit {limit_bytes} bytes exceeds the {total} bytes of {device}")
    torch.cuda.set_per_process_memory_fraction(limit_bytes / total, device)
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
    """Stretch compute to ``factor`` x its measured duration with duty-cycle sleeps.

    After each step of measured duration t the agent owes (factor - 1) x t of idle time; the debt is
    slept off once it reaches ``min_sleep`` and oversleeping is credited to the next steps. Sleeping
    after every step would overshoot: the step after a sleep runs on cold caches and measures slower,
    and that inflation is multiplied too (x2 came out as x3 on the 2-core CI host); sleeping every
    50 ms amortizes it. Sleeping, unlike busy work, leaves the shared cores to the other
    emulated devices, so a slowed device does not slow the rest. Pass ``sync`` on a GPU so t covers
    the kernels, not their launch.
    """

    def __init__(
        self,
        factor: float,
        *,
        sync: Callable[[], None] | None = None,
        min_sleep: float = 0.05,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not (factor >= 1 and math.isfinite(factor)):
            raise ValueError(f"slowdown factor must be a finite number >= 1, got {factor}")
        self.factor = factor
        self._sync = sync or (lambda: None)
        self._min_sleep = min_sleep
        self._clock = clock
        self._sleep = sleep
        self._debt = 0.0
        self.busy_seconds = 0.0
        self.slept_seconds = 0.0

    @contextmanager
    def step(self) -> Iterator[None]:
        """Wrap one training step (forward, backward, optimizer step)."""
        self._sync()
        start = self._clock()
        yield
        self._sync()
        elapsed = self._clock() - start
        self.busy_seconds += elapsed
        self._debt += (self.factor - 1) * elapsed
        if self._debt >= self._min_sleep:
            self.flush()

    def flush(self) -> None:
        """Sleep off the remaining debt, e.g. at the end of local training before uploading."""
        if self._debt <= 0:
            return
        start = self._clock()
        self._sleep(self._debt)
        slept = self._clock() - start
        self.slept_seconds += slept
        self._debt -= slept
