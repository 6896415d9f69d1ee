"""A device packed into a worker runs out of memory by accounting, the way it would on the device."""

from __future__ import annotations

import pytest
import torch

from device_agent.agent.config import EmulationConfig
from device_agent.emulation.accounting import MemoryAccount, MemoryCapExceeded
from device_agent.emulation.limits import EmulatedDevice
from device_agent.emulation.slots import ComputeSlots
from device_agent.training.oom import is_out_of_memory

_MIB = 2**20
CPU = torch.device("cpu")


def test_a_level_predicted_over_the_budget_is_refused_before_training() -> None:
    account = MemoryAccount(512 * _MIB, {1.0: 700 * _MIB, 0.5: 400 * _MIB}, CPU)
    with pytest.raises(MemoryCapExceeded, match=r"allows 512 MiB \(accounting\); the round at level 1 needs 700 MiB"):
        account.start(1.0)
    account.start(0.5)  # fits
    assert account.peak_bytes == 400 * _MIB
    account.start(0.25)  # no prediction for this level: nothing to hold it to on CPU
    assert account.peak_bytes == 0


def test_the_refusal_is_an_out_of_memory_as_the_runtime_reports_it() -> None:
    hooks = EmulatedDevice(
        EmulationConfig(memory_bytes=256 * _MIB, peak_bytes={1.0: 300 * _MIB}),
        CPU,
        compute_slot=ComputeSlots(1),
    )
    assert hooks.memory is None  # a device sharing a worker has no OS cap of its own
    with pytest.raises(MemoryCapExceeded) as refused:
        hooks.before_training(1.0)
    assert is_out_of_memory(refused.value)


def test_a_shared_device_takes_turns_in_the_compute_slot() -> None:
    slot = ComputeSlots(1)
    hooks = EmulatedDevice(EmulationConfig(step_seconds={1.0: 0.001}), CPU, compute_slot=slot)
    hooks.before_training(1.0)
    with hooks.step():
        assert slot.free == 0  # held while computing
    assert slot.free == 1  # released before sleeping off the step time


def test_a_shared_device_evaluates_in_its_turn_too() -> None:
    """Evaluations hold activations as steps do: 64 devices evaluating at once once filled an 80 GB GPU."""
    slot = ComputeSlots(1)
    hooks = EmulatedDevice(EmulationConfig(step_seconds={1.0: 0.001}), CPU, compute_slot=slot)
    with hooks.compute():
        assert slot.free == 0
    assert slot.free == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_measured_step_peak_counts_against_the_budget() -> None:
    cuda = torch.device("cuda")
    account = MemoryAccount(64 * _MIB, None, cuda)
    account.start(1.0)
    with account.measure():
        small = torch.empty(32 * _MIB, dtype=torch.uint8, device=cuda)
    assert 32 * _MIB <= account.peak_bytes < 64 * _MIB
    with pytest.raises(MemoryCapExceeded, match="measured peak"), account.measure():
        big = torch.empty(96 * _MIB, dtype=torch.uint8, device=cuda)
    del small, big
