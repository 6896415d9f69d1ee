"""The slot-policy benchmark runs both policies side by side and counts devices done by the deadline."""

from __future__ import annotations

import json

from benchmarks import slots


def test_both_policies_run_the_same_work_and_report_their_finishers(capsys) -> None:
    assert slots.main(["--devices", "4", "--steps", "3", "--step-ms", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["deadline_s"] == 4 * 3 * 0.001 / 2
    for policy in ("round_robin", "earliest_first"):
        assert 0 <= result[f"finished_{policy}"] <= 4
        assert 0 < result[f"median_finish_s_{policy}"] <= result[f"last_finish_s_{policy}"]
