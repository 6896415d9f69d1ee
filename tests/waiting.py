"""Waiting in tests for exactly what they assert: a condition polled until it holds, never a fixed sleep.

A fixed sleep before an assertion holds on an idle machine and fails on a loaded one (``make test-stress``
keeps every core busy to show it). Poll the asserted condition instead, with a deadline long enough for a
busy host: a passing test pays nothing for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable


def until(condition: Callable[[], object], timeout: float = 60.0, poll_s: float = 0.02) -> bool:
    """Poll ``condition`` until it holds or ``timeout`` seconds pass: whether it holds (assert on that)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            return bool(condition())
        time.sleep(poll_s)
    return True
