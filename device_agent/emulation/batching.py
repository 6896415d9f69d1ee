"""A worker's devices whose training steps run together: one batched step for the pending steps of a key.

Devices packed into a worker wait for its compute slots (:mod:`device_agent.emulation.slots`). With a
:class:`StepBatcher`, a device's step does not wait alone: it is queued, and the device that gets a slot
takes every queued step with the same key as its own (same program and model, level, batch shape,
hyperparameters; :meth:`~device_agent.training.batched.DeviceTrainer.key`) and runs them as one vectorized
step (:func:`~device_agent.training.batched.batched_step`), handing each device its loss; the devices
whose steps it took stop waiting for a slot. Nothing waits on purpose for a batch to fill: a batch is
what queued while the slot was busy, so an idle worker runs steps at once and a busy one runs them K at a
time. Everything else stays each device's own: its session, its evaluations (in the slot, one by one),
its upload and its device-time pace (it still sleeps off its step time after each step).

Batching pays where a step is per-operator overhead (small models, small batches, every step on a GPU)
and not where it is already compute-bound on a CPU core (the scale benchmark's full-width CNN at 14 px:
a batched step costs what K steps cost). The batcher measures both per key and runs a group as one step
only while that costs less per device than the device steps one by one (each one still taken on its own
module, as :func:`~device_agent.training.optimizer.train_local` takes it), trying the other way again
every :data:`RETRY_EVERY` groups.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch

from device_agent.emulation.slots import ComputeSlots
from device_agent.training.batched import DeviceTrainer, batched_step, single_step

RETRY_EVERY = 16
"""Groups between two tries of the mode that measured slower for a key (a host's load and K both drift)."""


@dataclass(eq=False)
class _Pending:
    trainer: DeviceTrainer
    step: int
    key: Hashable
    wake: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)
    taken: bool = False
    loss: float | None = None
    error: BaseException | None = None


@dataclass
class _Costs:
    """Seconds per device-step of one key, alone and batched (exponential averages; each mode's first group is
    a warm-up and not counted: the first batched step imports torch's compiler stack)."""

    alone: float | None = None
    batched: float | None = None
    groups: int = 0
    warm: set[bool] = field(default_factory=set)

    def batch(self, size: int) -> bool:
        """Whether a group of ``size`` steps runs batched: measure each mode first, then the cheaper one per
        device-step, the other again every :data:`RETRY_EVERY` groups."""
        if size < 2:
            return False
        self.groups += 1
        if self.batched is None:
            return True
        if self.alone is None:
            return False
        cheaper = self.batched < self.alone
        return not cheaper if self.groups % RETRY_EVERY == 0 else cheaper

    def note(self, batched: bool, seconds: float, size: int) -> None:
        if batched not in self.warm:
            self.warm.add(batched)
            return
        per_step = seconds / size
        old = self.batched if batched else self.alone
        value = per_step if old is None else 0.7 * old + 0.3 * per_step
        if batched:
            self.batched = value
        else:
            self.alone = value


class StepBatcher:
    """Runs the training steps of a worker's devices in its compute slots, batched where that is cheaper.

    ``max_batch``: the most steps one batched step takes (its activations are K devices'; size it to the
    memory of what computes: a GPU holds hundreds of the scale benchmark's steps, a CPU core's caches far fewer).
    """

    def __init__(self, slots: ComputeSlots, max_batch: int = 64, *, clock: Callable[[], float] | None = None) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.slots = slots
        self.max_batch = max_batch
        self._lock = threading.Lock()
        self._pending: list[_Pending] = []
        self._costs: dict[Hashable, _Costs] = {}
        self._clock = clock
        self.batched_steps = 0
        """Device steps that ran inside a batched step of two or more (for reports and tests)."""
        self.single_steps = 0

    @property
    def queued(self) -> int:
        """Steps waiting to be taken right now."""
        with self._lock:
            return len(self._pending)

    def step(self, trainer: DeviceTrainer, step: int, priority: float) -> float:
        """Device ``trainer``'s step ``step``, run by whichever device gets a slot first; its loss."""
        pending = _Pending(trainer, step, trainer.key(step))
        with self._lock:
            self._pending.append(pending)
        if self.slots.acquire(priority, wake=pending.wake, give_up=lambda: pending.taken):
            group: list[_Pending] = []
            try:
                group = self._take(pending)
                if group:
                    self.slots.run(lambda: self._compute(group))
            finally:
                self.slots.release()
                if group:
                    for member in group:
                        member.finished.set()
                        self.slots.wake(member.wake)
        pending.finished.wait()
        if pending.error is not None:
            raise pending.error
        assert pending.loss is not None
        return pending.loss

    def _take(self, own: _Pending) -> list[_Pending]:
        """The queued steps of ``own``'s key, ``own`` first; [] when another device already took ``own``."""
        with self._lock:
            if own.taken:
                return []
            others = [p for p in self._pending if p.key == own.key and p is not own]
            group = [own, *others[: self.max_batch - 1]]
            for member in group:
                member.taken = True
                self._pending.remove(member)
        return group

    def _compute(self, group: list[_Pending]) -> None:
        costs = self._costs.setdefault(group[0].key, _Costs())
        batched = costs.batch(len(group))
        device = group[0].trainer.device
        start = self._now(device)
        try:
            if batched:
                losses = batched_step([p.trainer for p in group], [p.step for p in group])
                self.batched_steps += len(group)
            else:
                losses = [single_step(p.trainer, p.step) for p in group]
                self.single_steps += len(group)
        except BaseException as exc:  # every device of the group gets what its own step would have raised
            for member in group:
                member.error = exc
            return
        costs.note(batched, self._now(device) - start, len(group))
        for member, loss in zip(group, losses, strict=True):
            member.loss = loss

    def _now(self, device: torch.device) -> float:
        if self._clock is not None:
            return self._clock()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            return time.perf_counter()
        return time.thread_time()  # the slot's own CPU: a loaded host's waits do not count


__all__ = ["RETRY_EVERY", "StepBatcher"]
