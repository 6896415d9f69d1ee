"""Property: a hello's profile, whatever a device puts in it, is a DeviceProfile or a ProtocolError.

The coordinator plans with what devices report, so the report is device-provided data: a malformed
one must be refused by the message parser, not blow up in a validator with a TypeError.
"""

import json

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from device_agent.common.profile import DeviceProfile
from device_agent.wire.messages import Hello, ProtocolError, parse_message
from profiles.catalog import profile_from_report
from tests.device_profiles import REPORTED_FIELDS

FUZZ = settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
anything = (
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8) | st.lists(st.integers(), max_size=2)
)
sizes = st.integers(-(2**70), 2**70) | st.sampled_from([0, 1, 2**30, "4 GiB", "lots"]) | anything
FLAT = ["cpu_count", "memory_total_bytes", "memory_available_bytes", "accelerator_memory_bytes", "matmul_gflops"]


def _hello(profile: dict) -> bytes:
    return json.dumps({"v": 3, "type": "hello", "device": "pi-1", "agent_version": "0.2", "profile": profile}).encode()


@FUZZ
@given(st.dictionaries(st.sampled_from(FLAT), sizes), st.sets(st.sampled_from(list(REPORTED_FIELDS)), max_size=3))
@example({"memory_total_bytes": "x"}, set())  # was a TypeError in the validator deriving memory
@example({}, {"memory_available_bytes"})  # was a KeyError
@example({"memory_total_bytes": [1]}, set())
@example({"memory_available_bytes": 2**70}, set())
def test_hello_profiles_parse_or_raise_protocol_error(changes, dropped):
    profile = {k: v for k, v in {**REPORTED_FIELDS, **changes}.items() if k not in dropped}
    try:
        hello = parse_message(_hello(profile))
    except ProtocolError as exc:
        assert "profile" in str(exc)
        return
    assert isinstance(hello, Hello) and isinstance(hello.profile, DeviceProfile)
    planned = profile_from_report(hello.profile)  # what the planner makes of it: a valid device class
    assert planned.memory.total == hello.profile.memory.total
