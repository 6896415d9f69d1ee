import json

import pytest

from benchmarks.probe_stability import main


@pytest.mark.slow
def test_benchmark_prints_one_json_object_with_both_worst_ratios(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--starts", "3", "--busy", "1", "--hogs", "2", "--seconds", "0.05", "--json"]) == 0

    result = json.loads(capsys.readouterr().out)
    assert result["single_worst_ratio"] > 0 and result["steady_worst_ratio"] > 0
    assert len(result["single_gflops"]) == len(result["steady_gflops"]) == 3


def test_every_start_cannot_be_busy() -> None:
    with pytest.raises(SystemExit):
        main(["--starts", "2", "--busy", "0,1"])
