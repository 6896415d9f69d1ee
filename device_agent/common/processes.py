"""Child processes that must not outlive the process that started them.

The emulator's agents, a benchmark's restarted agents and coordinator, and a managed broker all use
:func:`die_with_parent`: a parent killed with -9 (or a test run killed mid-way) then leaves no orphan
that keeps a device's broker session, its state lock, a port or a CPU busy.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent() -> None:
    """``preexec_fn`` (runs in the child between fork and exec): the kernel sends the child SIGTERM when its
    parent dies, even by SIGKILL (Linux prctl PR_SET_PDEATHSIG; elsewhere a no-op).

    The signal follows the *thread* that started the child, so start such children from a thread that
    lives as long as the process (the main thread). The kernel clears the setting when the child changes
    its user (as mosquitto does when it drops root): switch the user in ``Popen`` instead, which happens
    before this runs.
    """
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
