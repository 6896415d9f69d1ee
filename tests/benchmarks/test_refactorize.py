import json

from benchmarks.refactorize import main, run


def test_benchmark_times_both_schemes_and_matches_the_exact_truncated_svd():
    result = run("cnn", [0.5, 0.25], repeats=1)
    assert result["factorized_layers"] == 2
    assert result["reference_seconds"] > 0 and result["fedfleet_seconds"] > 0
    assert result["speedup"] > 0
    assert result["max_rel_error_gap"] < 1e-4
    assert result["reference_max_rel_error_gap"] < 1e-4
    assert max(result["ill_conditioned_error_gap_by_kept_span"].values()) < 1e-6


def test_json_output_is_one_object(capsys):
    assert main(["--arch", "cnn", "--repeats", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["benchmark"] == "refactorize"
