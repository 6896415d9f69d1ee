"""`coordinator plan` states the epsilon the configured private run reaches."""

import pytest

from coordinator.cli.app import main
from coordinator.privacy.accountant import planned_epsilon
from tests.paths import REPO_ROOT


def test_plan_prints_the_epsilon_of_the_configured_rounds_and_the_budget_stop(capsys: pytest.CaptureFixture[str]):
    assert main(["plan", "--fleet", str(REPO_ROOT / "examples" / "private.yaml")]) == 0
    out = capsys.readouterr().out
    epsilon = planned_epsilon(4, 4, 3, 2.0, 1e-5)
    assert f"privacy: user-level (epsilon, delta) = ({epsilon:.3g}, 1e-05) after 3 rounds" in out
    assert "the budget 8 stops it earlier" in out
