"""benchmarks.privacy: the cells it runs, the gap it reports, and one tiny real run."""

import json
import math

import pytest

from benchmarks import privacy


def test_epsilon_inf_runs_once_per_seed_and_the_gap_is_against_it():
    args = privacy.parse_args(["--seeds", "2", "--strategies", "fedavg"])
    cells = privacy.cells_for(args)
    assert sum(math.isinf(c.epsilon) for c in cells) == 2 and len(cells) == 2 * (1 + 2 * 2)
    rows = [
        {"strategy": "fedavg", "target_epsilon": None, "clip": None, "accuracy": 0.80, "epsilon": None},
        {"strategy": "fedavg", "target_epsilon": 8.0, "clip": "fixed", "accuracy": 0.77, "epsilon": 8.0},
        {"strategy": "fedavg", "target_epsilon": 8.0, "clip": "fixed", "accuracy": 0.73, "epsilon": 8.0},
    ]
    [baseline, private] = privacy.summarize(rows)
    assert baseline["gap_points"] == 0 and private["gap_points"] == pytest.approx(5.0)


@pytest.mark.slow
def test_a_tiny_run_reports_accuracy_and_the_accountants_epsilon(capsys):
    argv = ["--json", "--devices", "4", "--samples-per-device", "20", "--test-samples", "100", "--rounds", "1"]
    argv += ["--seeds", "1", "--strategies", "fedhm", "--epsilons", "inf,8", "--clips", "adaptive", "--jobs", "1"]
    assert privacy.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    private = next(c for c in report["cells"] if c["target_epsilon"] == 8.0)
    assert private["epsilon"] == pytest.approx(8.0, abs=1e-2)  # calibrated for the run's one round
    assert 0 <= private["accuracy"] <= 1 and isinstance(report["goal_met"], bool)
