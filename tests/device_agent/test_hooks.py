"""The runtime's hooks: nothing on a real device; on an emulated one, the profile it is held to."""

from __future__ import annotations

import pytest
import torch

from device_agent.config import EmulationConfig
from device_agent.hooks import RuntimeHooks
from device_agent.limits import EmulatedDevice, Throttle, runtime_hooks
from device_agent.probe import probe_device

CPU = torch.device("cpu")


def test_a_real_device_gets_hooks_that_change_nothing() -> None:
    hooks = runtime_hooks(None, CPU)
    assert type(hooks) is RuntimeHooks
    measured = probe_device(0.05, "cpu")
    assert hooks.profile(measured) == measured
    with hooks.memory_guard(), hooks.step():
        pass
    assert hooks.after_training() == 0.0


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
