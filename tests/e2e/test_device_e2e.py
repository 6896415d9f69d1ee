"""``make device-e2e`` as a test: a kit installs and trains on emulated arm64 bookworm (many minutes).

Runs only with FEDFLEET_DEVICE_E2E=1 (CI leaves it out) on a machine that has the prerequisites
(root, qemu-user-static with binfmt_misc, debootstrap, ip netns, mosquitto); otherwise it is skipped
with the reason. The first run also builds the cached rootfs and downloads the aarch64 wheels.
"""

from __future__ import annotations

import os

import pytest

from benchmarks.device_e2e import CACHE, measure, missing_prerequisites

pytestmark = pytest.mark.slow


def test_a_kit_installs_offline_and_trains_two_rounds_on_emulated_arm64_bookworm() -> None:
    if os.environ.get("FEDFLEET_DEVICE_E2E") != "1":
        pytest.skip("set FEDFLEET_DEVICE_E2E=1 to run it (it takes many minutes under qemu)")
    missing = missing_prerequisites()
    if missing:
        pytest.skip("missing: " + "; ".join(missing))
    result = measure(rounds=2, cache=CACHE, keep=False, timeout=2400)
    assert result["coordinator_exit"] == 0, result
    assert result["rounds_completed"] == 2, result
    assert float(result["venv_mib"]) > 100  # torch's own libraries: a real install, not a stub
    probe = result["probe"]
    assert isinstance(probe, dict) and probe["machine"] == "aarch64" and probe["torch"].startswith("2.")
    print(result)
