"""A long local round says how far it is: one line per interval with steps, time so far and time left."""

from __future__ import annotations

import logging

import pytest

from device_agent.training.progress import Pace, TrainingProgress


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_one_line_per_interval_with_the_time_left_at_the_pace_so_far(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    progress = TrainingProgress("pi4-01", 7, deadline_s=60, interval=10, clock=clock)
    caplog.set_level(logging.INFO, "fedfleet.agent")
    for done in range(1, 41):  # 40 steps of 1 s each
        clock.now += 1
        progress(done, 40)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "pi4-01: round 7: 10/40 steps (25 %) in 10 s, about 30 s left",
        "pi4-01: round 7: 20/40 steps (50 %) in 20 s, about 20 s left",
        "pi4-01: round 7: 30/40 steps (75 %) in 30 s, about 10 s left",
    ]


def test_a_round_that_will_miss_its_deadline_says_so(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    progress = TrainingProgress("pi4-01", 2, deadline_s=30, interval=10, clock=clock)
    caplog.set_level(logging.INFO, "fedfleet.agent")
    clock.now += 12
    progress(3, 12)
    assert caplog.records[-1].getMessage().endswith("about 36 s left (past the round's deadline)")


def test_a_round_is_expected_at_the_last_rounds_pace_at_its_level() -> None:
    pace = Pace()
    assert pace.expect(0.5, 1, deadline_s=60) == "no time expected yet (first round at this level)"
    pace.record(0.5, epochs=2, seconds=40)  # 20 s an epoch at level 0.5
    assert pace.expect(0.5, 1, deadline_s=60) == "expected about 20 s at the last round's pace"
    assert (
        pace.expect(0.5, 4, deadline_s=60) == "expected about 80 s at the last round's pace (past the round's deadline)"
    )
    assert pace.expect(1.0, 1, deadline_s=60) == "no time expected yet (first round at this level)"


def test_the_pace_counts_from_the_first_step_not_from_the_round_start(caplog: pytest.LogCaptureFixture) -> None:
    """Decoding, data loading and the evaluation of the received model come before training: not in its pace."""
    clock = Clock()
    progress = TrainingProgress("pi4-01", 1, deadline_s=60, interval=10, clock=clock)
    caplog.set_level(logging.INFO, "fedfleet.agent")
    clock.now += 30  # 30 s before the first step
    progress(0, 20)
    for done in range(1, 21):  # 20 steps of 1 s each
        clock.now += 1
        progress(done, 20)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["pi4-01: round 1: 10/20 steps (50 %) in 10 s, about 10 s left"]
