import json

import pytest

from benchmarks.export import bench, main, markdown


@pytest.mark.slow
def test_every_ratio_is_exported_checked_and_timed_against_full_rank():
    result = bench("cnn", [1.0, 0.25], repeats=2)
    assert [row["ratio"] for row in result["models"]] == [1.0, 0.25]
    assert result["max_abs_diff"] <= 1e-4
    assert all(row["top1_agreement"] == 1.0 and row["latency_ms_b1"] > 0 for row in result["models"])
    assert result["models"][1]["file_bytes"] < result["models"][0]["file_bytes"]
    assert result["ort_speedup_0.25"] > 0 and result["ort_speedup_b32_0.25"] > 0
    assert markdown(result).count("\n") == 3


@pytest.mark.slow
def test_json_output_is_one_object(capsys):
    assert main(["--arch", "cnn", "--ratios", "1/2", "--repeats", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["benchmark"] == "export" and "ort_speedup_0.5" in result
