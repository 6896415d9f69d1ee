import json

import pytest

from benchmarks.fedhm_classifier import main


@pytest.mark.slow
def test_every_rule_is_measured_on_both_splits(capsys):
    assert main(["--rounds", "1", "--seeds", "1", "--clients", "4", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    assert set(results) == {"dirichlet-0.5", "dirichlet-0.1"}
    for by_rule in results.values():
        assert set(by_rule) == {"off", "reference", "renormalised"}
        for cell in by_rule.values():
            assert 0 <= cell["global"]["mean"] <= 1 and 0 <= cell["personalized"]["mean"] <= 1
