"""One agent per state directory and per login on this machine: what `device-agent run` holds, `doctor` reads."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from device_agent.agent.lock import AlreadyRunning, claim_device, device_key, device_running_here, hold, running_agent


def test_a_held_lock_names_the_running_agent_and_refuses_a_second(tmp_path: Path) -> None:
    assert running_agent(tmp_path / "state") is None  # no agent ever ran here
    with hold(tmp_path / "state"):
        assert running_agent(tmp_path / "state") == os.getpid()
        with pytest.raises(AlreadyRunning, match=rf"pid {os.getpid()}\) is running with state dir"):
            hold(tmp_path / "state")
    assert running_agent(tmp_path / "state") is None  # released with the file: a stale lock blocks nothing
    with hold(tmp_path / "state"):
        pass


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract Unix sockets are Linux's")
def test_one_login_on_one_broker_is_claimed_once_per_machine(tmp_path: Path) -> None:
    """Whatever the state dir: a second unpacked copy of a kit has its own, and the same login."""
    key = device_key("broker.lab", 8883, "lab", "pi5-01")
    assert not device_running_here(key)
    with claim_device(key, tmp_path / "one"):
        assert device_running_here(key)
        assert not device_running_here(device_key("broker.lab", 8883, "lab", "pi5-02"))
        with pytest.raises(AlreadyRunning, match=r"for broker.lab:8883/lab/pi5-01 is running on this machine"):
            claim_device(key, tmp_path / "two")
    assert not device_running_here(key)  # released with the socket: nothing stale to clean up
