import json

from benchmarks.emulation import main


def test_json_output_reports_each_limit_as_a_ratio(capsys):
    args = ["--factors", "2", "--steps", "3", "--rates", "2e7", "--megabytes", "1", "--budgets-mib", "128", "--json"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["benchmark"] == "emulation"
    assert result["slowdown"][0]["factor"] == 2 and result["slowdown"][0]["measured_vs_own_compute"] > 1.5
    assert 0.5 < result["link"][0]["measured_vs_configured"] <= 1.05
    assert 0 < result["memory"][0]["largest_tensor_vs_budget"] <= 1
