"""Built models handed back after a round and taken again by the next program of the same spec.

A program's model is overwritten by its assignment anyway (every parameter and buffer but the norm
statistics), so building it anew each round only redoes work: module construction and
``to_empty`` were 14 of a device-round's 51 ms of CPU in a 300-device worker, training 17. A
worker's devices (and one device's successive rounds) share this pool: a model given back is reset
to what a fresh build gives before the assignment loads (norm statistics and their momentum, no
gradients, training mode) and is kept only while the pool holds under :data:`POOL_BYTES`. Models
with hooks, frozen parameters or tensors off the CPU are not kept: nothing of a round may leak into
the next.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from dataclasses import dataclass

from torch import nn

POOL_BYTES = 64 * 2**20
"""Most bytes of parameters and buffers the idle models of one process may hold."""

_NORM = nn.modules.batchnorm._NormBase


@dataclass
class Pooled:
    """A built model and what a fresh build of it had that a round may change."""

    model: nn.Module
    momenta: list[float | None]
    nbytes: int

    @classmethod
    def fresh(cls, model: nn.Module) -> Pooled:
        momenta = [module.momentum for module in model.modules() if isinstance(module, _NORM)]
        nbytes = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
        return cls(model, momenta, nbytes)

    def reusable(self) -> bool:
        """Whether a round left the model as the pool can restore it."""
        tensors = (*self.model.parameters(), *self.model.buffers())
        hooked = any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks for m in self.model.modules())
        return (
            not hooked
            and all(t.device.type == "cpu" for t in tensors)
            and all(p.requires_grad for p in self.model.parameters())
        )

    def reset(self) -> None:
        """Back to a fresh build's state for everything an assignment does not load."""
        self.model.zero_grad(set_to_none=True)
        norms = [module for module in self.model.modules() if isinstance(module, _NORM)]
        for norm, momentum in zip(norms, self.momenta, strict=True):
            norm.momentum = momentum
            norm.reset_running_stats()
        self.model.train()


class ModelPool:
    """Idle built models by spec key; thread-safe (a worker's devices run in threads)."""

    def __init__(self, max_bytes: int = POOL_BYTES) -> None:
        self.max_bytes = max_bytes
        self._idle: dict[Hashable, list[Pooled]] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def take(self, key: Hashable) -> Pooled | None:
        with self._lock:
            idle = self._idle.get(key)
            if not idle:
                return None
            pooled = idle.pop()
            self._bytes -= pooled.nbytes
        return pooled

    def give(self, key: Hashable, pooled: Pooled) -> bool:
        """Keep ``pooled`` for the next take of ``key``; False when it cannot be reused or the pool is full."""
        if not pooled.reusable():
            return False
        with self._lock:
            if self._bytes + pooled.nbytes > self.max_bytes:
                return False
            self._bytes += pooled.nbytes
        pooled.reset()
        with self._lock:
            self._idle.setdefault(key, []).append(pooled)
        return True

    @property
    def idle_bytes(self) -> int:
        return self._bytes


MODELS = ModelPool()
"""The process's pool: every program of the default load path takes from and gives back to it."""
