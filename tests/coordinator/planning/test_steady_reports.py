"""Measured reports: bounded by the device's profile, said once, and only changed by real changes."""

from __future__ import annotations

import logging

import pytest

from coordinator.planning.steady_reports import SteadyReports
from device_agent.common.profile import DeviceProfile
from profiles.catalog import load_catalog
from tests.device_profiles import reported_profile

LAPTOP = load_catalog()["rtx-4060-laptop"]
GIB = 1024**3


def _report(gflops: float, available: int = 6 * GIB) -> DeviceProfile:
    return reported_profile(
        hostname="laptop",
        machine="x86_64",
        cpu_count=8,
        memory_total_bytes=16 * GIB,
        memory_available_bytes=available,
        matmul_gflops=gflops,
    )


def test_a_reading_far_below_the_profile_is_bounded_and_explained_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="fedfleet.planning")
    reports = SteadyReports()
    expected = LAPTOP.compute.fp32_gflops

    first = reports.adopt("laptop-01", _report(4.8), LAPTOP)
    again = reports.adopt("laptop-01", _report(5.5), LAPTOP)

    assert first.compute.fp32_gflops == again.compute.fp32_gflops == expected / 2
    assert [r.getMessage() for r in caplog.records] == [
        f"laptop-01: measured 4.8 GFLOPS vs profile {expected:g} (rtx-4060-laptop); using {expected / 2:.1f}: "
        "more than 2x below the profile is more likely a busy host or a wrong profile than the device "
        "(if it is real, set devices[].overrides.compute.fp32_gflops)"
    ]


def test_small_changes_keep_the_report_in_use_and_large_ones_replace_it() -> None:
    reports = SteadyReports()
    expected = LAPTOP.compute.fp32_gflops
    reports.adopt("laptop-01", _report(expected, available=6 * GIB), LAPTOP)

    wobble = reports.adopt("laptop-01", _report(expected * 0.85, available=5 * GIB), LAPTOP)
    change = reports.adopt("laptop-01", _report(expected * 0.6, available=2 * GIB), LAPTOP)

    assert wobble.compute.fp32_gflops == expected
    assert wobble.memory.usable_bytes == 6 * GIB
    assert change.compute.fp32_gflops == pytest.approx(expected * 0.6)
    assert change.memory.usable_bytes == 2 * GIB


def test_a_device_without_a_static_profile_is_taken_at_its_word() -> None:
    assert SteadyReports().adopt("box", _report(36.6), None).compute.fp32_gflops == 36.6
