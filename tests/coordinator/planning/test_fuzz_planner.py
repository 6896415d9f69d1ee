"""Property: whatever a device's hello reports, the coordinator plans it (a ratio or a reason) or the parser refuses it.

Planning runs in the engine's loop at every round's start, so an exception here would stop the run.
"""

import json
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from coordinator.config.fleet import load_fleet
from coordinator.planning.planner import plan_fleet
from device_agent.wire.messages import Hello, ProtocolError, parse_message
from tests.device_profiles import REPORTED_FIELDS

FUZZ = settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
FLEET = """
fleet: lab
broker: {mode: external, url: 'mqtt://127.0.0.1:1883'}
model: {arch: cnn, num_classes: 10}
ratios: [1, 1/2]
devices:
  - {id: pi-1, profile: reported}
  - {id: pi-2, profile: raspberry-pi-5}
"""
extremes = st.sampled_from([5e-324, 1e-300, 1e-3, 1.0, 1e300, math.inf, 0.0, -1.0]) | st.floats(allow_nan=False)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    path: Path = tmp_path_factory.mktemp("planner") / "fleet.yaml"
    path.write_text(FLEET)
    fleet, catalog = load_fleet(path)
    # Trace the model at every level once (seconds on a loaded machine), outside the examples' deadline.
    warm = parse_message(
        json.dumps({"v": 3, "type": "hello", "device": "pi-1", "agent_version": "0.2", "profile": REPORTED_FIELDS})
    )
    plan_fleet(fleet, catalog, {"pi-1": warm.profile})
    return fleet, catalog


@FUZZ
@given(
    st.fixed_dictionaries(
        {"fp32_gflops": extremes},
        optional={"memory_bandwidth_gbs": extremes, "training_efficiency": extremes, "kernel_overhead_us": extremes},
    ),
    st.fixed_dictionaries({"downlink_mbps": extremes, "uplink_mbps": extremes, "latency_ms": extremes}),
    st.sampled_from([1, 2, 1 << 20, 4 << 30, 2**63 - 1]),
    st.sampled_from(["pi-1", "pi-2"]),
)
@example({"fp32_gflops": 5e-324}, {"downlink_mbps": 1.0, "uplink_mbps": 1.0, "latency_ms": 0.0}, 4 << 30, "pi-1")
@example(
    {"fp32_gflops": 1.0, "training_efficiency": 5e-324},
    {"downlink_mbps": 1.0, "uplink_mbps": 1.0, "latency_ms": 0.0},
    4 << 30,
    "pi-2",
)
def test_any_reported_profile_is_planned_or_refused_by_the_parser(fleet, compute, network, memory, device):
    profile = {**REPORTED_FIELDS, "memory_total_bytes": memory, "memory_available_bytes": 0}
    hello = {"v": 3, "type": "hello", "device": device, "agent_version": "0.2", "profile": profile}
    hello["profile"] |= {"compute": compute, "network": network}
    try:
        message = parse_message(json.dumps(hello).encode())
    except ProtocolError:
        return
    assert isinstance(message, Hello)
    fleet_, catalog = fleet
    plans = {plan.device: plan for plan in plan_fleet(fleet_, catalog, {device: message.profile})}
    assert plans[device].ratio in (None, *fleet_.ratios)
    assert plans[device].ratio is not None or plans[device].reason
