"""The README's first command, literally: `make demo` on a machine without mosquitto.

examples/demo.yaml asks for a managed TLS broker, which only mosquitto serves. Without it the
emulation falls back to the plain amqtt development broker and says so loudly; `coordinator start`
on the same fleet still refuses (a real fleet never silently loses TLS).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.cli.start import PLAIN_FALLBACK_WARNING
from coordinator.transport.broker.mosquitto import MOSQUITTO_ENV
from tests.paths import REPO_ROOT

pytestmark = pytest.mark.slow


def _without_mosquitto() -> dict[str, str]:
    """This environment with mosquitto gone: off PATH, and the absolute candidates disowned."""
    path = [p for p in os.environ["PATH"].split(os.pathsep) if not (Path(p) / "mosquitto").exists()]
    return {**os.environ, "PATH": os.pathsep.join(path), MOSQUITTO_ENV: "none"}


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
@pytest.mark.skipif(not (REPO_ROOT / ".venv" / "bin" / "coordinator").exists(), reason="no .venv: run `make setup`")
def test_make_demo_without_mosquitto_runs_on_the_amqtt_fallback_and_says_so(tmp_path: Path) -> None:
    env = _without_mosquitto()
    assert shutil.which("mosquitto", path=env["PATH"]) is None
    run_dir = tmp_path / "demo"
    args = f"--rounds 2 --no-live --run-dir {run_dir}"
    done = subprocess.run(
        ["make", "demo", f"DEMO_ARGS={args}"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "WITHOUT TLS" in output and "amqtt" in output
    assert PLAIN_FALLBACK_WARNING.split(",")[0] in output
    rounds = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2]
    assert all(d["status"] == "accepted" for r in rounds for d in r["devices"].values())
    assert len(rounds[0]["devices"]) == 9


def test_coordinator_start_still_refuses_a_tls_fleet_without_mosquitto(tmp_path: Path) -> None:
    venv = REPO_ROOT / ".venv" / "bin" / "coordinator"
    command = [str(venv)] if venv.exists() else [sys.executable, "-m", "coordinator"]
    done = subprocess.run(
        [*command, "start", "--fleet", str(REPO_ROOT / "examples" / "demo.yaml"), "--run-dir", str(tmp_path / "r")],
        env=_without_mosquitto(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "broker.tls: a managed TLS broker runs mosquitto, which is not installed here" in done.stderr
