"""Every way a device says "out of memory" is recognized as one, and nothing else is."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from device_agent.emulation.limits import MemoryCapExceeded
from device_agent.training.oom import free_memory, is_out_of_memory


def _cpu_allocator_failure() -> RuntimeError:
    """What torch's CPU allocator really raises when a tensor does not fit (1 PiB never does)."""
    try:
        torch.empty(2**50, dtype=torch.uint8)
    except RuntimeError as exc:
        return exc
    raise AssertionError("allocated 1 PiB")


@pytest.mark.parametrize(
    "exc",
    [
        _cpu_allocator_failure(),
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 7.6 GiB total capacity)"),
        RuntimeError("MPS backend out of memory (MPS allocated: 5.2 GB, other allocations: 1.1 GB)"),
        RuntimeError("[enforce fail at alloc_cpu.cpp:87] DefaultCPUAllocator: not enough memory: you tried to ..."),
        MemoryError(),
        MemoryCapExceeded("emulated device memory cap exceeded: the profile allows 300 MiB"),
    ],
    ids=["cpu-allocator", "cuda", "mps", "cpu-allocator-windows", "python", "emulated-cap"],
)
def test_out_of_memory_is_recognized_on_every_backend(exc: BaseException) -> None:
    assert is_out_of_memory(exc)


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (32x10 and 12x10)"),
        ValueError("no local training data"),
        OSError("out of memory"),  # not an allocator's error, whatever it says
    ],
)
def test_other_failures_are_not_out_of_memory(exc: BaseException) -> None:
    assert not is_out_of_memory(exc)


def test_the_emulated_cap_is_a_memory_error_so_it_takes_the_same_path() -> None:
    assert issubclass(MemoryCapExceeded, MemoryError)


def test_free_memory_runs_without_an_accelerator() -> None:
    free_memory()


CUDA_FRACTION = """
import torch
from device_agent.training.oom import free_memory, is_out_of_memory

total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction(256 * 2**20 / total, 0)  # a 256 MiB GPU
try:
    torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
except Exception as exc:
    print("oom", is_out_of_memory(exc))
free_memory()
torch.empty(128 * 2**20, dtype=torch.uint8, device="cuda")  # the next, smaller round still fits
print("fits")
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_real_cuda_allocation_past_the_memory_fraction_is_out_of_memory() -> None:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CUDA_FRACTION)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["oom", "True", "fits"]
