"""The README's first command, literally: `make demo` on a machine without mosquitto, then with it.

examples/demo.yaml asks for a managed TLS broker, which only mosquitto serves. Without it the
emulation falls back to the plain amqtt development broker and says so loudly; `coordinator start`
on the same fleet still refuses (a real fleet never silently loses TLS). After `apt-get install
mosquitto`, as that banner advises, the same demo runs on mosquitto with TLS: the kits the fallback
wrote are provisioned again with TLS, and their broker files are handed to the mosquitto user.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.cli.start import PLAIN_FALLBACK_WARNING
from coordinator.transport.broker.mosquitto import MOSQUITTO_ENV, find_mosquitto
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
    assert "transport.broker.tls: a managed TLS broker runs mosquitto, which is not installed here" in done.stderr


@pytest.fixture
def demo_folder() -> Iterator[Path]:
    """examples/demo.yaml in a folder the mosquitto user can enter, as a clone's examples/ is; its kits go beside."""
    folder = Path(tempfile.mkdtemp(prefix="fedfleet-demo-"))
    os.chmod(folder, 0o711)
    shutil.copy(REPO_ROOT / "examples" / "demo.yaml", folder / "demo.yaml")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _demo(folder: Path, env: dict[str, str], run_dir: Path) -> str:
    """What `make demo DEMO_ARGS="--rounds 1 --no-live --run-dir RUN"` runs, on the fleet in ``folder``."""
    env = {**env, "PYTHONPATH": str(REPO_ROOT)}
    fleet = str(folder / "demo.yaml")
    output = ""
    for command in (["plan", "--fleet", fleet], ["emulate", "--fleet", fleet, "--rounds", "1", "--no-live"]):
        if command[0] == "emulate":
            command += ["--run-dir", str(run_dir)]
        done = subprocess.run(
            [sys.executable, "-m", "coordinator", *command], env=env, capture_output=True, text=True, timeout=600
        )
        output += done.stdout + done.stderr
        assert done.returncode == 0, output[-4000:]
    rounds = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1] and len(rounds[0]["devices"]) == 9
    assert all(d["status"] == "accepted" for d in rounds[0]["devices"].values())
    return output


@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed (apt-get install mosquitto)")
def test_make_demo_without_mosquitto_then_after_installing_it(demo_folder: Path, tmp_path: Path) -> None:
    before = _demo(demo_folder, _without_mosquitto(), tmp_path / "amqtt")
    assert "WITHOUT TLS" in before and "broker: mqtt://127.0.0.1:18830 (amqtt, MQTT 3.1.1)" in before
    kits = demo_folder / "kits" / "demo"
    assert json.loads((kits / "fleet.json").read_text())["tls"] is False
    if os.geteuid() == 0:
        # As a machine without the mosquitto user writes them: the broker's secrets root's, 0600.
        for private in (kits / "broker" / "passwd", kits / "broker" / "data"):
            os.chown(private, 0, 0)
    after = _demo(demo_folder, dict(os.environ), tmp_path / "mosquitto")
    assert "WITHOUT TLS" not in after
    assert f"the kits in {kits} were provisioned without TLS" in after
    assert "broker: mqtts://127.0.0.1:18830 (managed, MQTT 5)" in after
    assert json.loads((kits / "fleet.json").read_text())["tls"] is True
    assert "url: mqtts://" in (kits / "orin-01" / "agent.yaml").read_text()
