"""Emulation limits, checked on real processes: threads, a memory cap that stops them, a measured slowdown."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
import torch

from device_agent.emulation.limits import Throttle, slowdown_factor, thread_env


def run_python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.slow
def test_thread_limit_applies_in_the_agent_process() -> None:
    done = run_python(
        """
        import torch
        from device_agent.emulation.limits import limit_threads
        limit_threads(1)
        print(torch.get_num_threads())
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1"
    assert thread_env(3) == {"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "3", "OPENBLAS_NUM_THREADS": "3"}


AGENT_WITH_A_CAP = """
import sys, torch
from device_agent.emulation.limits import cap_cpu_memory, MemoryCapExceeded
# One compute thread, as an emulated agent has: on a many-core host every OpenMP thread's malloc arena
# reserves address space of its own, which RLIMIT_AS counts.
torch.set_num_threads(1)
cap = cap_cpu_memory(300 * 2**20)
with cap.guard():
    fits = torch.ones(64 * 2**20 // 4)  # a 64 MiB model fits in a 300 MiB device
print("fits", float(fits.sum()), flush=True)
try:
    with cap.guard():
        torch.ones({mib} * 2**20 // 4)
except MemoryCapExceeded as exc:
    print(exc, file=sys.stderr)
    sys.exit(3)
print("no cap", flush=True)
"""


@pytest.mark.slow
def test_the_cpu_memory_cap_stops_an_allocation_past_it_with_a_clear_error() -> None:
    done = run_python(AGENT_WITH_A_CAP.format(mib=600))
    assert done.returncode == 3, done.stdout + done.stderr
    assert done.stdout.strip() == f"fits {64 * 2**20 // 4}.0"
    assert "emulated device memory cap exceeded: the profile allows 300 MiB (address-space limit, RLIMIT_AS)" in (
        done.stderr
    )


@pytest.mark.slow
def test_the_cpu_memory_cap_leaves_room_up_to_the_budget() -> None:
    done = run_python(AGENT_WITH_A_CAP.format(mib=150))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "no cap"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_cuda_memory_cap_stops_an_allocation_past_it() -> None:
    done = run_python(
        """
        import sys, torch
        from device_agent.emulation.limits import cap_cuda_memory, MemoryCapExceeded
        cap = cap_cuda_memory(512 * 2**20)
        with cap.guard():
            fits = torch.ones(256 * 2**20 // 4, device="cuda")
        print("fits", flush=True)
        try:
            with cap.guard():
                torch.ones(1024 * 2**20 // 4, device="cuda")
        except MemoryCapExceeded as exc:
            print(exc, file=sys.stderr)
            sys.exit(3)
        """
    )
    assert done.returncode == 3, done.stdout + done.stderr
    assert done.stdout.strip() == "fits"
    assert "memory cap exceeded: the profile allows 512 MiB (CUDA memory fraction" in done.stderr


def test_slowdown_factor_is_host_over_profile_and_never_speeds_up() -> None:
    assert slowdown_factor(host_gflops=120.0, profile_gflops=30.0) == 4.0
    assert slowdown_factor(host_gflops=50.0, profile_gflops=380.0) == 1.0
    with pytest.raises(ValueError, match="profile_gflops must be a positive number"):
        slowdown_factor(100.0, 0.0)


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds * 1.1  # the OS oversleeps by 10 %


def test_throttle_owes_factor_minus_one_times_each_step_and_credits_oversleep() -> None:
    fake = FakeTime()
    throttle = Throttle(3.0, min_sleep=0.005, clock=fake.clock, sleep=fake.sleep)
    for _ in range(10):
        with throttle.step():
            fake.now += 0.001  # 1 ms of compute: owes 2 ms, slept every third step
    throttle.flush()
    assert throttle.busy_seconds == pytest.approx(0.010)
    assert throttle.slept_seconds == pytest.approx(0.020, rel=0.12)
    assert fake.now == pytest.approx(3.0 * throttle.busy_seconds, rel=0.12)
    assert len(fake.sleeps) <= 5
    with pytest.raises(ValueError, match=">= 1"):
        Throttle(0.5)


@pytest.mark.slow
def test_throttled_training_runs_factor_times_slower_than_unthrottled() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batch, labels = torch.randn(256, 256), torch.randint(0, 10, (256,))

    def train_step() -> None:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(batch), labels).backward()
        optimizer.step()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core, as an emulated agent gets
    try:
        for _ in range(3):
            train_step()  # warm-up
        throttle = Throttle(3.0)
        plain = throttled = 0.0
        for _ in range(4):  # alternating blocks, so both see the same load from the other jobs on the machine
            start = time.perf_counter()
            for _ in range(10):
                train_step()
            plain += time.perf_counter() - start
            start = time.perf_counter()
            for _ in range(10):
                with throttle.step():
                    train_step()
            throttle.flush()
            throttled += time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)

    # Against its own measured compute the stretch is exact up to sleep granularity; against the
    # unthrottled blocks next to it, the shared cores add noise, hence the generous band.
    assert throttled / throttle.busy_seconds == pytest.approx(3.0, rel=0.15)
    assert 3.0 * 0.6 < throttled / plain < 3.0 * 1.6


def test_a_step_time_holds_each_step_to_it_and_never_speeds_a_slow_step_up() -> None:
    fake = FakeTime()
    throttle = Throttle(step_seconds=0.004, min_sleep=0.005, clock=fake.clock, sleep=fake.sleep)
    for _ in range(10):
        with throttle.step():
            fake.now += 0.001  # 1 ms on the host, 4 ms on the device: owes 3 ms
    throttle.flush()
    assert fake.now == pytest.approx(10 * 0.004, rel=0.12)
    throttle.step_seconds = 0.0005  # the next round's level is cheaper than the host's step
    start, slept = fake.now, throttle.slept_seconds
    for _ in range(10):
        with throttle.step():
            fake.now += 0.001
    throttle.flush()
    assert throttle.slept_seconds == slept  # slower than the device: nothing owed, nothing gained
    assert fake.now - start == pytest.approx(0.010)
    with pytest.raises(ValueError, match="step_seconds must be a positive number"):
        Throttle(step_seconds=0.0)
