"""The coordinator's GIL hand-over: shorter for its socket thread, never longer than what was set."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from device_agent.common.threads import IO_SWITCH_INTERVAL_S, favour_io_threads


@pytest.fixture(autouse=True)
def _restore_interval() -> Iterator[None]:
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


def test_favour_io_threads_shortens_the_default_switch_interval() -> None:
    sys.setswitchinterval(0.005)
    favour_io_threads()
    assert sys.getswitchinterval() == pytest.approx(IO_SWITCH_INTERVAL_S, rel=0.05)


def test_favour_io_threads_keeps_an_interval_already_set_shorter() -> None:
    sys.setswitchinterval(0.0001)
    favour_io_threads()
    assert sys.getswitchinterval() == pytest.approx(0.0001, rel=0.05)
