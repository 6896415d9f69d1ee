"""One device-side round: whatever a round raises becomes a RoundFailure, and the device takes the next round."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import TypeVar

import pytest
import torch
from torch import Tensor

from coordinator.strategies import ClientSlot, ModelSpec, build_strategy
from device_agent.clients import PROGRAMS
from device_agent.clients.base import KeptStateMissing
from device_agent.clients.spec import TrainConfig
from device_agent.data.datasets import DatasetError
from device_agent.training.driver import NoHooks, RoundFailure, classify, run_assignment
from device_agent.training.local_round import TrainedRound
from device_agent.wire.codec import encode_tensors
from device_agent.wire.messages import Assignment
from tests.program_bugs import BUG, with_first_upload_bug

CNN = ModelSpec("cnn", 10, 1, 8)
Split = tuple[Tensor, Tensor]
T = TypeVar("T")


class NothingKept:
    """A device of a strategy that keeps nothing between rounds."""

    def load(self, run: str) -> Mapping[str, Tensor] | None:
        return None

    def save(self, run: str, tensors: Mapping[str, Tensor]) -> None:
        assert not tensors


def fedavg_round(round_: int) -> tuple[Assignment, bytes]:
    sent = build_strategy("fedavg", CNN, {}, seed=0).configure(round_, [ClientSlot("dev-a", 1.0, 64)])["dev-a"]
    assignment = Assignment(
        run="r1", round=round_, deadline_s=60, download="a" * 32, spec=sent.spec, train=TrainConfig()
    )
    return assignment, encode_tensors(sent.tensors)


def digits(_assignment: Assignment) -> tuple[Split, Split]:
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 1, 8, 8, generator=generator), torch.randint(0, 10, (64,), generator=generator)
    return (x, y), (x[:16], y[:16])


def test_a_program_raising_type_error_fails_its_round_with_type_and_message_and_the_next_round_trains(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assignment, payload = fedavg_round(1)
    name = assignment.spec.strategy
    monkeypatch.setitem(PROGRAMS, name, with_first_upload_bug(PROGRAMS[name]))

    failed = run_assignment(assignment, payload, digits, NothingKept())
    trained = run_assignment(*fedavg_round(2), digits, NothingKept())

    assert failed == RoundFailure("error", "TypeError", BUG)
    assert failed.to_message(assignment).detail == f"TypeError: {BUG}"
    assert isinstance(trained, TrainedRound) and trained.result.samples == 64


class Turns(NoHooks):
    """Records each turn a round takes (a packed device computes only in one) and the work it runs there."""

    def __init__(self) -> None:
        self.turns: list[str] = []
        self._in: str | None = None

    @contextmanager
    def _turn(self, name: str) -> Iterator[None]:
        self._in = name
        yield
        self._in = None

    def step(self) -> AbstractContextManager[object]:
        return self._turn("step")

    def compute(self) -> AbstractContextManager[object]:
        return self._turn("compute")

    def run_compute(self, work: Callable[[], T]) -> T:
        assert self._in is not None, "tensor work ran outside a turn"
        self.turns.append(self._in)
        return work()


def test_a_rounds_work_runs_in_turns_evaluations_around_its_training_steps_then_the_packing() -> None:
    hooks = Turns()
    trained = run_assignment(*fedavg_round(1), digits, NothingKept(), hooks=hooks)
    assert isinstance(trained, TrainedRound)
    assert trained.received is not None and trained.local_accuracy is not None
    assert hooks.turns == ["compute"] + ["step"] * trained.result.steps + ["compute", "compute"]


class OutOfMemoryOnce(NoHooks):
    """The first training step builds garbage in a reference cycle (as autograd graphs do), then runs out of memory."""

    def __init__(self) -> None:
        self.garbage: weakref.ref[Tensor] | None = None

    @contextmanager
    def step(self) -> Iterator[None]:
        if self.garbage is None:
            activations = torch.zeros(1 << 20)
            cycle: list[object] = [activations]
            cycle.append(cycle)
            self.garbage = weakref.ref(activations)
            del activations, cycle
            raise MemoryError("the emulated 64 MiB cap is exceeded")
        yield


def test_out_of_memory_gives_the_failed_rounds_memory_back_before_the_next_round() -> None:
    hooks = OutOfMemoryOnce()
    gc.disable()  # only the driver's own collection may free the cycle
    try:
        failed = run_assignment(*fedavg_round(1), digits, NothingKept(), hooks=hooks)
        freed = hooks.garbage is not None and hooks.garbage() is None
    finally:
        gc.enable()
    trained = run_assignment(*fedavg_round(2), digits, NothingKept(), hooks=hooks)

    assert failed == RoundFailure("out_of_memory", "MemoryError", "the emulated 64 MiB cap is exceeded")
    assert freed
    assert isinstance(trained, TrainedRound)


def test_a_payload_that_is_not_safetensors_is_a_bad_assignment() -> None:
    assignment, _ = fedavg_round(1)
    failed = run_assignment(assignment, b"not a safetensors file", digits, NothingKept())
    assert isinstance(failed, RoundFailure) and (failed.reason, failed.error_type) == ("bad_assignment", "CodecError")


def test_unreadable_data_fails_the_round_as_an_error_logged_without_a_traceback(caplog) -> None:
    def no_data(_assignment: Assignment) -> tuple[Split, Split]:
        raise DatasetError("data share 3 of 2 is empty")

    failed = run_assignment(*fedavg_round(1), no_data, NothingKept())
    assert failed == RoundFailure("error", "DatasetError", "data share 3 of 2 is empty")
    [record] = [r for r in caplog.records if "data share 3 of 2 is empty" in r.getMessage()]
    assert record.levelname == "ERROR" and record.exc_info is None


@pytest.mark.parametrize(
    ("exc", "reason"),
    [
        (KeptStateMissing("v and mu are gone"), "state_lost"),
        (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), "out_of_memory"),
        (RuntimeError("DefaultCPUAllocator: can't allocate memory"), "out_of_memory"),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), "error"),
        (KeyError("fc.weight"), "error"),
    ],
)
def test_one_classification_names_the_reason_the_coordinator_acts_on(exc: Exception, reason: str) -> None:
    assert classify(exc) == RoundFailure(reason, type(exc).__name__, str(exc))
