"""Broker scratch folders: gone when their process exits, swept at the next start after a kill -9."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from coordinator.transport.broker.mosquitto import find_mosquitto
from coordinator.transport.broker.scratch import OWNER_FILE, scratch_dir, sweep_stale
from tests.paths import REPO_ROOT

ROOT = REPO_ROOT

MAKE = (
    "from coordinator.transport.broker.scratch import scratch_dir; print(scratch_dir('fedfleet-t-broker-'), flush=True)"
)


def run_child(tmp_path: Path, then: str) -> Path:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", f"{MAKE}; {then}"], env=env, capture_output=True, text=True)
    return Path(done.stdout.strip())


def test_a_scratch_folder_is_removed_when_its_process_exits(tmp_path: Path) -> None:
    folder = run_child(tmp_path, "pass")

    assert folder.parent == tmp_path and not folder.exists()


def test_one_left_by_a_killed_process_is_swept_and_live_or_foreign_ones_are_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    killed = run_child(tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert (killed / OWNER_FILE).is_file()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ours = scratch_dir("fedfleet-live-broker-")
    foreign = tmp_path / "fedfleet-other-broker-x"
    foreign.mkdir()

    assert sweep_stale() == [killed]
    assert ours.exists() and foreign.exists() and not killed.exists()


@pytest.mark.slow
@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")
def test_the_suites_broker_fixture_leaves_no_folder_behind() -> None:
    child = "from tests.transport_fixtures import _start; print(_start('mosquitto').broker.workdir, flush=True)"
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True, cwd=ROOT)
    folder = Path(done.stdout.strip())

    assert folder.name.startswith("fedfleet-broker-") and not folder.exists()
