"""``device-agent run`` as a real process against the test mosquitto."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import REPO_ROOT

ROOT = REPO_ROOT


@pytest.mark.slow
def test_an_agent_whose_password_is_refused_exits_with_an_error_instead_of_idling(mosquitto, tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text("not-the-password")
    address = mosquitto.address("dev-a")
    command = [sys.executable, "-m", "device_agent", "run", "--device", "dev-a", "--fleet", mosquitto.fleet]
    command += ["--broker", f"mqtt://{address.host}:{address.port}", "--password", f"file:{secret}"]
    command += ["--state-dir", str(tmp_path / "state"), "--log-level", "WARNING"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("device-agent: error: broker mqtt://") and "refused the login of user 'dev-a'" in last
    assert "--password" in last
