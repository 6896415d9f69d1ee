"""The async demo end to end: `coordinator emulate --fleet examples/async.yaml` (FedBuff over nine real agents
held to their profiles and a managed mosquitto); only the broker port is changed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from coordinator.transport.broker.base import free_port
from coordinator.transport.broker.mosquitto import find_mosquitto
from tests.paths import REPO_ROOT

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed"),
]


def test_the_async_demo_publishes_every_version_from_all_three_classes_and_learns(tmp_path: Path) -> None:
    fleet = yaml.safe_load((REPO_ROOT / "examples" / "async.yaml").read_text())
    fleet["transport"]["broker"]["port"] = free_port()
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(fleet, sort_keys=False))
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "coordinator", "emulate", "--fleet", str(tmp_path / "fleet.yaml")]
    done = subprocess.run(
        [*command, "--run-dir", str(run_dir), "--no-live"], capture_output=True, text=True, timeout=600, cwd=REPO_ROOT
    )

    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    versions = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    buffer = fleet["strategy"]["async"]["buffer"]
    assert [v["round"] for v in versions] == list(range(1, fleet["rounds"] + 1))
    assert all(v["asynchronous"]["updates"] == buffer for v in versions)
    assert {row["ratio"] for v in versions for row in v["devices"].values()} == {1.0, 0.5, 0.25}
    assert max(v["accuracy"] for v in versions) > 0.9
    report = (run_dir / "report.html").read_text()
    assert "Staleness (async)" in report
