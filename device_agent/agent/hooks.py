"""The points where the agent runtime lets something else shape a device: none on real hardware.

The runtime calls these hooks and nothing else: an emulated device
(:class:`device_agent.emulation.limits.EmulatedDevice`) holds the process to a profile through them, a test can
inject a failure through them, and a real device runs the no-op defaults below. Subclass and
override what you need.

Where each is called:

- :meth:`RuntimeHooks.profile` once at start-up, on the measured profile, before ``hello``;
- :meth:`RuntimeHooks.memory_guard` around a round's work (building, training, evaluating, packing);
- :meth:`RuntimeHooks.before_training` once before local training, with the level it trains;
- :meth:`RuntimeHooks.step` around every optimizer step (forward, backward, update);
- :meth:`RuntimeHooks.run_compute` runs each step's body and each evaluation (inside ``step``/``compute``);
- :meth:`RuntimeHooks.step_batcher` once per round: what takes the training steps instead, if anything;
- :meth:`RuntimeHooks.after_training` once local training ends, then :meth:`RuntimeHooks.held_seconds`;
- :meth:`RuntimeHooks.before_upload` before an update is offered to the coordinator;
- :meth:`RuntimeHooks.before_chunk_out` / :meth:`RuntimeHooks.after_chunk_in` by the transport's
  threads, around every chunk sent or received (so they must be thread-safe).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, TypeVar

import torch

from device_agent.common.profile import DeviceProfile

if TYPE_CHECKING:
    from device_agent.training.batched import StepRunner

T = TypeVar("T")


class RuntimeHooks:
    """No-op hooks: the runtime as it runs on a real device."""

    def profile(self, measured: DeviceProfile) -> DeviceProfile:
        """The profile the coordinator plans with."""
        return measured

    def memory_guard(self) -> AbstractContextManager[object]:
        """A context around one round's work; may turn an allocation failure into a clearer ``MemoryError``."""
        return nullcontext()

    def before_training(self, level: float) -> None:
        """Called before local training of a model at ``level`` (an emulated device's step time depends on it)."""

    def step(self) -> AbstractContextManager[object]:
        """A context around one training step."""
        return nullcontext()

    def compute(self) -> AbstractContextManager[object]:
        """A context around the round's other compute (evaluating the received and the trained model)."""
        return nullcontext()

    def run_compute(self, work: Callable[[], T]) -> T:
        """Runs one piece of the round's tensor work and returns its result (a packed GPU worker picks the thread)."""
        return work()

    def step_batcher(self) -> StepRunner | None:
        """What takes this round's training steps when they may run together with other devices' (a worker's
        batcher, :mod:`device_agent.emulation.batching`); None: each step runs in :meth:`step` as usual."""
        return None

    def after_training(self) -> float:
        """Called when local training ends; returns extra seconds it spent that count as training time."""
        return 0.0

    def held_seconds(self) -> float:
        """Seconds of the last local training spent held back to a device's pace (sleeping), not computing."""
        return 0.0

    def before_upload(self) -> None:
        """Called before each update is sent (one request/response exchange)."""

    def before_chunk_out(self, nbytes: int) -> None:
        """Called before a chunk of ``nbytes`` is published."""

    def after_chunk_in(self, nbytes: int) -> None:
        """Called after a chunk of ``nbytes`` arrived."""


HooksFor = Callable[[torch.device], RuntimeHooks]
"""Makes a device's hooks once its torch device is known (the CLI injects the emulated device's this way)."""
