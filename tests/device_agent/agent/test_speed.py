"""The start-up speed measurement: the median of repeats and of the last starts, kept in the state dir."""

from __future__ import annotations

import json
from pathlib import Path

from device_agent.agent.speed import KEPT_STARTS, SPEED_FILE, measured_profile, steady_gflops

WHO = {"hostname": "pi5-01", "accelerator": "cpu", "accelerator_name": None, "torch": "2.13"}


def test_one_busy_start_does_not_sink_the_speed(tmp_path: Path) -> None:
    for quiet in ([180.0, 190.0, 175.0], [200.0, 185.0, 190.0]):
        steady_gflops(quiet, WHO, tmp_path)

    busy = steady_gflops([4.8, 36.6, 12.0], WHO, tmp_path)

    assert busy == 180.0  # the median of the starts' medians 180, 190 and 12
    assert json.loads((tmp_path / SPEED_FILE).read_text())["gflops"] == [180.0, 190.0, 12.0]


def test_only_the_last_starts_are_kept(tmp_path: Path) -> None:
    for gflops in range(1, KEPT_STARTS + 3):
        steady_gflops([float(gflops)], WHO, tmp_path)

    assert json.loads((tmp_path / SPEED_FILE).read_text())["gflops"] == [3.0, 4.0, 5.0, 6.0, 7.0]


def test_another_machine_or_a_damaged_file_is_no_history(tmp_path: Path) -> None:
    steady_gflops([10.0], {**WHO, "accelerator": "cuda"}, tmp_path)
    assert steady_gflops([100.0], WHO, tmp_path) == 100.0

    (tmp_path / SPEED_FILE).write_text("{not json")
    assert steady_gflops([50.0], WHO, tmp_path) == 50.0


def test_the_agents_profile_reports_the_steady_speed(tmp_path: Path) -> None:
    profile = measured_profile("cpu", tmp_path, seconds=0.02)

    kept = json.loads((tmp_path / SPEED_FILE).read_text())
    assert profile.compute.fp32_gflops == profile.matmul_gflops == kept["gflops"][-1] > 0


def test_a_busy_second_start_does_not_halve_the_first(tmp_path: Path) -> None:
    steady_gflops([190.0], WHO, tmp_path)

    assert steady_gflops([20.0], WHO, tmp_path) == 190.0
