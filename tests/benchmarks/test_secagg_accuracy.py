"""benchmarks.secagg_accuracy: one secure round over the engine lands within the quantization bound of the plain one."""

import json
import math

import pytest

from benchmarks import secagg_accuracy


@pytest.mark.slow
def test_one_secure_round_moves_the_weights_by_at_most_the_quantization_error(capsys):
    argv = ["--json", "--devices", "4", "--samples-per-device", "20", "--test-samples", "100", "--rounds", "1"]
    argv += ["--seeds", "1"]
    assert secagg_accuracy.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    half_step = report["clip"] / (2 ** report["bits"] - 1)
    fedavg, fedhm = report["runs"]
    # FedAvg: 4 equal shares, each device's value off by half a step at most: the mean too (plus float32 rounding).
    assert 0 < fedavg["weights_max_abs_difference"] <= half_step + 1e-6
    # FedHM weighs device i by exp(gamma_i - 1) (levels 1, 1/2, 1/4, 1): 4 half steps over the weights' sum.
    weights = sum(math.exp(level - 1) for level in (1.0, 0.5, 0.25, 1.0))
    assert 0 < fedhm["weights_max_abs_difference"] <= 4 * half_step / weights + 1e-6
    assert report["clamped_fraction"] == 0.0
    assert fedhm["secure"]["survivors"] == [4]
    assert len(fedavg["plain"]["accuracy"]) == len(fedavg["secure"]["accuracy"]) == 1
    # The summary over seeds keeps every seed's final accuracy, plain and secure, beside the means.
    over_seeds = report["fedhm_final_accuracy_over_seeds"]
    assert over_seeds["secure"]["seeds"] == [fedhm["secure"]["accuracy"][-1]]
    assert report["fedhm_plain_accuracy"] == round(fedhm["plain"]["accuracy"][-1], 4)
    assert report["fedhm_plain_seed_std_points"] is None  # one seed: no spread
