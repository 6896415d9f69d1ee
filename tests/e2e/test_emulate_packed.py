"""`coordinator emulate` packing devices into worker processes, end to end over a real mosquitto."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import yaml

from coordinator.transport.broker.base import free_port
from coordinator.transport.broker.mosquitto import find_mosquitto
from tests.paths import REPO_ROOT

ROOT = REPO_ROOT
DEMO = ROOT / "examples" / "demo.yaml"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed"),
]


def test_six_devices_in_two_workers_complete_their_rounds(tmp_path: Path) -> None:
    fleet = yaml.safe_load(DEMO.read_text())
    fleet["transport"]["broker"]["port"] = free_port()
    fleet["rounds"] = 2
    fleet["devices"] = [d for i, d in enumerate(fleet["devices"]) if i % 3 != 2]  # two of each class
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(fleet, sort_keys=False))
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "coordinator", "emulate", "--fleet", str(path), "--run-dir", str(run_dir)]
    command += ["--no-live", "--pack-above", "4"]  # 6 > 4: packed, DEVICES_PER_WORKER would make it one worker
    command += ["--workers", "2", "--batch"]  # CPU workers train one by one unless told
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=ROOT)
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if str(run_dir) in " ".join(p.info["cmdline"] or [])]
    assert leftovers == [], "workers left running after the emulation ended"
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "emulating 6 devices packed into 2 worker processes (3 per worker" in done.stdout
    assert "workers batch the training steps of devices with the same model, level and batch shape" in done.stdout

    rounds = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rounds) == 2
    for record in rounds:
        assert {d["status"] for d in record["devices"].values()} == {"accepted"}
        assert {d["ratio"] for d in record["devices"].values()} == {1.0, 0.5, 0.25}
    workers = run_dir / "agents" / "workers"
    lists = sorted(workers.glob("worker-*.yaml"))
    assert [p.name for p in lists] == ["worker-00.yaml", "worker-01.yaml"]
    for agent_list in lists:
        hosted = [Path(p).parent.name for p in yaml.safe_load(agent_list.read_text())]
        log = agent_list.with_suffix(".log").read_text()
        assert len(hosted) == 3
        assert "steps batched, up to 32" in log
        assert "training steps ran batched" in log  # the count as the worker stopped
        for device in hosted:  # each device trained in its worker, with its own state directory
            assert f"{device}: round 2 trained" in log
            assert (run_dir / "agents" / device / "state").is_dir()
        assert "Traceback" not in log
