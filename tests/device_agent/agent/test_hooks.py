"""The runtime's hooks: nothing on a real device; on an emulated one, the profile it is held to."""

from __future__ import annotations

import pytest
import torch

from device_agent.agent.config import EmulationConfig
from device_agent.agent.hooks import RuntimeHooks
from device_agent.agent.probe import probe_device
from device_agent.common.profile import ComputeSpec
from device_agent.emulation.limits import EmulatedDevice, Throttle, runtime_hooks

CPU = torch.device("cpu")


def test_a_real_device_gets_hooks_that_change_nothing() -> None:
    hooks = runtime_hooks(None, CPU)
    assert type(hooks) is RuntimeHooks
    measured = probe_device(0.05, "cpu")
    assert hooks.profile(measured) == measured
    with hooks.memory_guard(), hooks.step():
        pass
    assert hooks.after_training() == 0.0
    assert hooks.held_seconds() == 0.0


def test_an_emulated_device_tells_the_coordinator_the_profile_it_is_held_to() -> None:
    # No threads or memory_bytes here: those limits are process-wide (see test_limits, which uses subprocesses).
    emulation = EmulationConfig(slowdown=4.0, uplink_bytes_per_s=1e6, downlink_bytes_per_s=2e6, latency_s=0.02)
    hooks = runtime_hooks(emulation, CPU)
    assert isinstance(hooks, EmulatedDevice) and hooks.memory is None
    measured = probe_device(0.05, "cpu")
    told = hooks.profile(measured)
    assert told.compute.fp32_gflops == pytest.approx(measured.compute.fp32_gflops / 4)
    assert told.memory == measured.memory
    assert (told.network.uplink_mbps, told.network.downlink_mbps, told.network.latency_ms) == pytest.approx(
        (8.0, 16.0, 20.0)
    )


def test_an_emulated_device_counts_its_slowdown_as_training_time() -> None:
    now = [0.0]
    hooks = EmulatedDevice(EmulationConfig(slowdown=3.0), CPU)
    hooks.throttle = Throttle(3.0, min_sleep=1.0, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    with hooks.step():
        now[0] += 0.1  # 0.1 s of compute owes 0.2 s, below min_sleep: still owed when training ends
    assert hooks.after_training() == pytest.approx(0.2)
    assert hooks.after_training() == 0.0


def test_device_time_holds_each_level_to_its_step_time_and_reports_the_profile_compute() -> None:
    compute = ComputeSpec(fp32_gflops=36.0, memory_bandwidth_gbs=8.0)
    emulation = EmulationConfig(step_seconds={0.25: 0.01, 1.0: 0.03}, compute=compute)
    hooks = EmulatedDevice(emulation, CPU)
    assert hooks.throttle is not None and hooks.throttle.factor == 1.0
    now = [0.0]
    hooks.throttle = Throttle(min_sleep=1.0, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    for level, host_step in ((1.0, 0.004), (0.25, 0.004)):
        hooks.before_training(level)
        for _ in range(5):
            with hooks.step():
                now[0] += host_step
        # the sleeps of this round are training time, and what the host did not compute
        assert hooks.after_training() + 5 * host_step == pytest.approx(5 * emulation.step_seconds[level])
        assert hooks.held_seconds() == pytest.approx(5 * (emulation.step_seconds[level] - host_step))
    with pytest.raises(ValueError, match=r"no step time for level 0.5 \(it has 0.25, 1\)"):
        hooks.before_training(0.5)
    told = hooks.profile(probe_device(0.05, "cpu"))
    assert told.compute == compute and told.matmul_gflops == 36.0


def test_step_time_and_slowdown_are_two_paces_not_one() -> None:
    with pytest.raises(ValueError, match="exclude each other"):
        EmulationConfig(slowdown=2.0, step_seconds={1.0: 0.01})
