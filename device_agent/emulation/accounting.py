"""Memory held by accounting: how a device that shares its process with others still runs out of memory.

An agent alone in its process gets a hard OS cap (:func:`device_agent.emulation.limits.cap_cpu_memory`), but
devices packed into one worker share an address space and one CUDA context, so no per-device cap
exists. Each one is held instead to what its round needs, by two figures:

- the predicted peak of a round at the level it is assigned (``emulation.peak_bytes``, written by the
  coordinator from its cost model: the agent does not carry the cost model), checked before training;
- on CUDA, the measured peak of every step (``torch.cuda.max_memory_allocated`` above what was
  allocated when the round began), checked after each step. On CPU torch keeps no per-thread
  allocation figure, so the predicted peak is the one that counts there.

Either above the device's budget fails the round with :class:`MemoryCapExceeded`, a ``MemoryError``,
which the runtime reports as ``out_of_memory`` as it would on the device; the planner then steps the
device one level down. On a GPU the measured figure is exact only while one device computes at a
time (a worker's single compute slot, the default): tensors another device allocates mid-step count too.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch


class MemoryCapExceeded(MemoryError):
    """The emulated device ran out of memory: a ``MemoryError``, reported as ``out_of_memory`` like any other."""


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


class MemoryAccount:
    """One device's memory budget, checked against its predicted and (on CUDA) measured round peak."""

    def __init__(
        self,
        budget_bytes: int,
        predicted: Mapping[float, int] | None,
        device: torch.device,
        *,
        shared: bool = True,
    ) -> None:
        """``shared``: the process hosts other devices too, so measured peaks are this device's to check."""
        if budget_bytes <= 0:
            raise ValueError(f"memory budget must be positive, got {budget_bytes}")
        self.budget_bytes = int(budget_bytes)
        self.predicted = dict(predicted or {})
        self._measure = shared and device.type == "cuda"
        self._device = device
        self._base = 0
        self.level: float | None = None
        self.peak_bytes = 0
        """The largest figure this round was held to so far (predicted or measured)."""

    def predicted_at(self, level: float) -> int | None:
        for key, nbytes in self.predicted.items():
            if math.isclose(key, level, rel_tol=1e-9):
                return nbytes
        return None

    def start(self, level: float) -> None:
        """Begin a round at ``level``: refuse it at once when its predicted peak is over the budget."""
        self.level = level
        predicted = self.predicted_at(level)
        self.peak_bytes = predicted or 0
        if predicted is not None:
            self._check(predicted, "predicted")
        if self._measure:
            self._base = torch.cuda.memory_allocated(self._device)

    @contextmanager
    def measure(self) -> Iterator[None]:
        """Wrap one step: on CUDA, its measured peak above the round's start counts against the budget."""
        if not self._measure:
            yield
            return
        torch.cuda.reset_peak_memory_stats(self._device)
        yield
        measured = torch.cuda.max_memory_allocated(self._device) - self._base
        self.peak_bytes = max(self.peak_bytes, measured)
        self._check(measured, "measured")

    def _check(self, nbytes: int, how: str) -> None:
        if nbytes > self.budget_bytes:
            level = "" if self.level is None else f" at level {self.level:g}"
            raise MemoryCapExceeded(
                f"emulated device memory cap exceeded: the profile allows {_mib(self.budget_bytes)} "
                f"(accounting); the round{level} needs {_mib(nbytes)} ({how} peak)"
            )
