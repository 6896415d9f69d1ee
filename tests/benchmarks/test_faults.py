"""The fault benchmark on a quick subset: an agent and the coordinator killed -9 mid-upload lose nothing."""

import json
import tempfile
from pathlib import Path

import pytest

from benchmarks.faults import main
from coordinator.transport.broker.mosquitto import find_mosquitto
from coordinator.transport.broker.pidfile import live_owner
from coordinator.transport.broker.scratch import OWNER_FILE, PATTERN


@pytest.mark.slow
@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")
@pytest.mark.parametrize(
    ("scenario", "title"),
    [("agent", "kill -9 one agent mid-upload"), ("coordinator", "kill -9 the coordinator mid-upload")],
)
def test_a_killed_process_loses_no_update_and_leaves_nothing_behind(scenario, title, capsys):
    before = set(Path(tempfile.gettempdir()).glob(PATTERN))

    assert main(["--scenarios", scenario, "--repeats", "1", "--no-bad-inputs", "--json"]) == 0

    row = json.loads(capsys.readouterr().out)["scenarios"][title]
    assert row["lost_updates"] == 0, row
    assert row["survived"] is True and row["rounds_completed"] == 1, row
    assert "acknowledged updates checked" in row["detail"]
    if scenario == "coordinator":
        assert "says it is complete" in row["detail"]
    new = set(Path(tempfile.gettempdir()).glob(PATTERN)) - before
    # None left behind by a process that is gone (a folder whose owner still runs is another job's).
    orphans = [f for f in new if (f / OWNER_FILE).is_file() and live_owner(f / OWNER_FILE) is None]
    assert not orphans


def test_an_unknown_scenario_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        main(["--scenarios", "agent,meteor"])
    assert "unknown scenario(s) meteor; choose from agent, half" in capsys.readouterr().err


def test_an_update_refused_at_the_close_is_judged_not_lost(tmp_path, monkeypatch) -> None:
    import json

    from benchmarks.faults import FleetRun

    run = FleetRun.__new__(FleetRun)
    monkeypatch.setattr(FleetRun, "run_dir", tmp_path, raising=False)
    monkeypatch.setattr(FleetRun, "acknowledged", lambda self: {("a", 1), ("b", 1), ("c", 1), ("a", 2)})
    rows = [
        {
            "round": 1,
            "devices": {"a": {"status": "accepted"}, "b": {"status": "rejected", "reason": "wrong_direction"}},
        },
        {"round": 2, "devices": {"a": {"status": "accepted"}}},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert run.refused_at_close() == [("b", 1)]
    assert run.lost_updates() == 1  # c's acknowledged update is in no round's count: lost
