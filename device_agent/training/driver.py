"""One assigned round on the device side, from the received bytes to a trained round or a failure.

The agent runtime calls :func:`run_assignment` over any transport (MQTT, or memory in a simulation),
so every device answers the same failure the same way. Whatever goes wrong inside a round (a client program's
bug, a payload that does not fit, a device out of memory, unreadable data) becomes a
:class:`RoundFailure` with one reason code from :func:`classify`, the exception's type and its message;
the device answers ``round_failed`` and takes the next round. Nothing a program raises may end the
device: under systemd a crash would restart it, get the same assignment re-sent and crash again until
the round's deadline. After an out-of-memory the failed round's memory is given back before returning.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch
from torch import Tensor

from device_agent.clients.assignment_check import BadAssignment
from device_agent.clients.base import KeptStateMissing
from device_agent.data.datasets import DatasetError
from device_agent.training.local_round import TrainedRound, train_assignment
from device_agent.training.oom import free_memory, is_out_of_memory
from device_agent.wire.codec import CodecError, decode_tensors
from device_agent.wire.messages import Assignment, FailureReason, RoundFailed

if TYPE_CHECKING:
    from device_agent.training.batched import StepRunner

log = logging.getLogger("fedfleet.round")

Split = tuple[Tensor, Tensor]
T = TypeVar("T")


class KeptState(Protocol):
    """What a device keeps between rounds of one run (personalized parts); on disk on a real device."""

    def load(self, run: str) -> Mapping[str, Tensor] | None: ...

    def save(self, run: str, tensors: Mapping[str, Tensor]) -> None: ...


class RoundHooks(Protocol):
    """The part of the agent's runtime hooks a round calls (an emulated device paces and caps it there)."""

    def before_training(self, level: float) -> None: ...

    def memory_guard(self) -> AbstractContextManager[object]: ...

    def step(self) -> AbstractContextManager[object]: ...

    def compute(self) -> AbstractContextManager[object]: ...

    def run_compute(self, work: Callable[[], T]) -> T: ...

    def step_batcher(self) -> StepRunner | None: ...


class NoHooks:
    """A round as it runs on real hardware: nothing paced, nothing capped."""

    def before_training(self, level: float) -> None:
        """Nothing to prepare."""

    def memory_guard(self) -> AbstractContextManager[object]:
        return nullcontext()

    def step(self) -> AbstractContextManager[object]:
        return nullcontext()

    def compute(self) -> AbstractContextManager[object]:
        return nullcontext()

    def run_compute(self, work: Callable[[], T]) -> T:
        return work()

    def step_batcher(self) -> StepRunner | None:
        return None


@dataclass(frozen=True)
class RoundFailure:
    """A round the device could not do: the reason code the coordinator acts on, and what was raised."""

    reason: FailureReason
    error_type: str
    message: str

    @property
    def detail(self) -> str:
        return f"{self.error_type}: {self.message}"

    def to_message(self, assignment: Assignment) -> RoundFailed:
        """The ``round_failed`` answer to ``assignment`` (detail cut to what the protocol carries)."""
        return RoundFailed(run=assignment.run, round=assignment.round, reason=self.reason, detail=self.detail[:2000])


def classify(exc: Exception) -> RoundFailure:
    """The one failure classification of a device's round.

    ``state_lost``: a personalized program lost what it keeps between rounds (the coordinator starts it
    over); ``bad_assignment``: the payload does not decode or fit the spec's model; ``out_of_memory``
    however the backend says it (the coordinator plans the device lower); ``error``: anything else,
    a program's bug or unreadable data included.
    """
    reason: FailureReason
    if isinstance(exc, KeptStateMissing):
        reason = "state_lost"
    elif isinstance(exc, (BadAssignment, CodecError)):
        reason = "bad_assignment"
    elif is_out_of_memory(exc):
        reason = "out_of_memory"
    else:
        reason = "error"
    return RoundFailure(reason, type(exc).__name__, str(exc))


def run_assignment(
    assignment: Assignment,
    payload: bytes,
    data: Callable[[Assignment], tuple[Split, Split]],
    kept: KeptState,
    device: torch.device | str = "cpu",
    hooks: RoundHooks | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> TrainedRound | RoundFailure:
    """Train ``assignment`` on the received ``payload``; never raises for what goes wrong in the round.

    ``data(assignment)`` gives the device's (train, test) shards for the assignment's model; ``kept``
    is loaded before and saved after training. Only what is not an ``Exception`` passes through
    (KeyboardInterrupt, SystemExit): it stops the device on purpose.

    Pass ``payload`` as the only reference to it: it is freed once decoded, and the decoded tensors once the
    program has loaded them (:func:`train_assignment`), not held for the whole round (a worker's devices
    are all mid-round at once: two copies of the model each, 190 MB per worker of 250 at 1,000 devices).
    """
    hooks = hooks or NoHooks()
    spec = assignment.spec
    try:
        decoded = [decode_tensors(payload)]
        del payload
        shard, test = data(assignment)
        hooks.before_training(spec.level)
        with hooks.memory_guard():
            trained = train_assignment(
                spec,
                assignment.train,
                decoded.pop(),
                kept.load(assignment.run),
                shard,
                test,
                device,
                step=hooks.step,
                compute=hooks.compute,
                run=hooks.run_compute,
                progress=progress,
                batch=hooks.step_batcher(),
            )
        kept.save(assignment.run, trained.keep)
        return trained
    except Exception as exc:
        failure = classify(exc)
        if isinstance(exc, DatasetError):  # a named problem of this device's data: its message says it all
            log.error("round %d of run %s: %s", assignment.round, assignment.run, failure.detail)
        elif failure.reason == "error":
            log.exception("round %d of run %s: %s", assignment.round, assignment.run, failure.detail)
    # Out of the except block the exception and its traceback are gone, and with them the round's tensors.
    if failure.reason == "out_of_memory":
        free_memory()
    return failure


__all__ = ["KeptState", "NoHooks", "RoundFailure", "RoundHooks", "classify", "run_assignment"]
