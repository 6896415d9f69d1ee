"""die_with_parent: a child started with it ends when its parent is killed -9; one started without it lives on."""

import signal
import subprocess
import sys
import time

import psutil
import pytest

PARENT = """\
import subprocess, sys, time
from device_agent.common.processes import die_with_parent
child = subprocess.Popen(["sleep", "300"], preexec_fn=die_with_parent if sys.argv[1] == "tied" else None)
print(child.pid, flush=True)
time.sleep(300)
"""


def gone(pid: int, within_s: float) -> bool:
    """Whether ``pid`` has ended (a zombie has ended too: only its exit status is left) within ``within_s``."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux only")
@pytest.mark.parametrize(("mode", "dies"), [("tied", True), ("free", False)])
def test_a_child_dies_with_its_killed_parent_only_when_tied(mode, dies):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, mode], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        parent.send_signal(signal.SIGKILL)
        parent.wait()

        assert gone(child, within_s=10) is dies
    finally:
        if psutil.pid_exists(child):
            psutil.Process(child).kill()
        parent.stdout.close()
