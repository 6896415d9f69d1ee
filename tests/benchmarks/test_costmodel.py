"""A reduced run of benchmarks.costmodel: the JSON it prints has the keys the README quotes."""

from __future__ import annotations

import pytest

from benchmarks import costmodel


@pytest.mark.slow
def test_reduced_benchmark_reports_memory_and_time_errors() -> None:
    result = costmodel.run(
        {"cnn": (16,)},
        steps=2,
        optimizer="sgd",
        probe_seconds=0.05,
        threads=1,
        gammas=(1.0, 0.25),
        calibration=("cnn", 1.0, 16),
    )

    assert {"memory_rel_error_max", "time_ratio_rel_error_max", "training_efficiency", "configs", "machine"} <= set(
        result
    )
    assert len(result["configs"]) == 2
    for row in result["configs"]:
        assert row["peak_bytes"] > 0 and row["predicted_peak_bytes"] > 0
        assert row["step_seconds"] > 0 and row["predicted_step_seconds"] > 0
        # Timed twice: as the agent allocates, and in the memory process (every large tensor a fresh mmap).
        assert row["fixed_mmap_step_seconds"] > 0 and "fixed_mmap_time_ratio_rel_error" in row
    calibrated = result["configs"][0]
    if result["training_efficiency"] < 1:  # efficiency is capped at 1: then the calibration row cannot be exact
        assert calibrated["time_ratio_rel_error"] == pytest.approx(0, abs=1e-6), "the calibration row is exact"
    assert result["memory_rel_error_max"] == max(abs(r["memory_rel_error"]) for r in result["configs"])
    assert result["fixed_mmap_time_ratio_rel_error_max"] == max(
        abs(r["fixed_mmap_time_ratio_rel_error"]) for r in result["configs"]
    )
