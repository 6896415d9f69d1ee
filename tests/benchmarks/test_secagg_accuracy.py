"""benchmarks.secagg_accuracy: one round through SecAgg+ lands within the quantization bound of the float mean."""

import json

import pytest

from benchmarks import secagg_accuracy


@pytest.mark.slow
def test_one_secure_round_moves_the_weights_by_at_most_half_a_step(capsys):
    argv = ["--json", "--devices", "4", "--samples-per-device", "20", "--test-samples", "100", "--rounds", "1"]
    argv += ["--seeds", "1"]
    assert secagg_accuracy.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    step = 2 * report["clip"] / (2 ** report["bits"] - 1)
    # The mean of 4 quantized updates is within step / 2 of the float mean; float32 weights add a rounding.
    [run] = report["runs"]
    assert 0 < run["weights_max_abs_difference"] <= step / 2 + 1e-6
    assert report["clipped_fraction"] == 0.0
    assert len(run["plain"]["accuracy"]) == len(run["secure"]["accuracy"]) == 1
