"""A reduced run of benchmarks.costmodel: the JSON it prints has the keys the README quotes."""

from __future__ import annotations

import pytest

from benchmarks import costmodel


@pytest.mark.slow
def test_reduced_benchmark_reports_memory_and_time_errors_of_both_sets() -> None:
    result = costmodel.run(
        {"cnn": (16,)},
        steps=2,
        optimizer="sgd",
        probe_seconds=0.05,
        threads=1,
        gammas=(1.0,),
        held_out=(("cnn28", 0.25, 16),),
    )

    assert {"memory_rel_error_max", "time_ratio_rel_error_max", "held_out_time_ratio_rel_error_max"} <= set(result)
    assert result["fitted_to_timed_steps"] is False
    machine = result["machine"]
    # The prediction's inputs are the probe's: the reused and the fresh-mapping bandwidth, the conv efficiency.
    assert machine["memory_bandwidth_gbs"] > 0 and machine["fresh_memory_bandwidth_gbs"] > 0
    assert machine["training_efficiency"] > 0
    assert [(r["set"], r["arch"]) for r in result["configs"]] == [("default", "cnn"), ("held_out", "cnn28")]
    for row in result["configs"]:
        assert row["peak_bytes"] > 0 and row["predicted_peak_bytes"] > 0
        assert row["step_seconds"] > 0 and row["predicted_step_seconds"] > 0
        # Timed twice: as the agent allocates, and in the memory process (every large tensor a fresh mmap).
        assert row["fixed_mmap_step_seconds"] > 0
    assert result["memory_rel_error_max"] == max(abs(r["memory_rel_error"]) for r in result["configs"])
    assert result["time_ratio_rel_error_max"] == max(abs(r["time_ratio_rel_error"]) for r in result["configs"])
    assert result["held_out_time_ratio_rel_error_max"] == abs(result["configs"][1]["time_ratio_rel_error"])
