"""One agent per state directory: the lock ``device-agent run`` holds and ``doctor`` looks at."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from device_agent.agent.lock import AlreadyRunning, hold, running_agent


def test_a_held_lock_names_the_running_agent_and_refuses_a_second(tmp_path: Path) -> None:
    assert running_agent(tmp_path / "state") is None  # no agent ever ran here
    with hold(tmp_path / "state"):
        assert running_agent(tmp_path / "state") == os.getpid()
        with pytest.raises(AlreadyRunning, match=rf"pid {os.getpid()}\) is running with state dir"):
            hold(tmp_path / "state")
    assert running_agent(tmp_path / "state") is None  # released with the file: a stale lock blocks nothing
    with hold(tmp_path / "state"):
        pass
