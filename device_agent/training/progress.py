"""Progress lines while a device trains: on a slow device a round is minutes of silence otherwise."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger("fedfleet.agent")

PROGRESS_INTERVAL_S = 10.0
"""Seconds between two progress lines of one round (none for a round shorter than this)."""


class Pace:
    """Seconds one local epoch took at each level on this device, to predict a round before it starts.

    A device's share is the same every round, so the last round at a level is the best guess for the next
    (the first round at a level has none: its progress lines give the time left once it runs).
    """

    def __init__(self) -> None:
        self._epoch_s: dict[float, float] = {}

    def record(self, level: float, epochs: int, seconds: float) -> None:
        self._epoch_s[level] = seconds / max(epochs, 1)

    def expect(self, level: float, epochs: int, deadline_s: float) -> str:
        """Words for the round-start line: the expected time, and whether it misses the deadline."""
        epoch_s = self._epoch_s.get(level)
        if epoch_s is None:
            return "no time expected yet (first round at this level)"
        expected = epoch_s * epochs
        late = " (past the round's deadline)" if expected > deadline_s else ""
        return f"expected about {expected:.0f} s at the last round's pace{late}"


class TrainingProgress:
    """Called with (steps done, steps in the round) before the first training step (0 done) and after each;
    logs at most every ``interval`` s.

    Each line gives the steps done, the time so far and the time left at the pace so far, so an operator
    sees how far a long round is and whether it will make its deadline.
    """

    def __init__(
        self,
        device: str,
        round_: int,
        deadline_s: float,
        interval: float = PROGRESS_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.device, self.round, self.deadline_s, self.interval, self.clock = (
            device,
            round_,
            deadline_s,
            interval,
            clock,
        )
        self.start = clock()
        self.next_line = self.start + interval

    def __call__(self, done: int, total: int) -> None:
        now = self.clock()
        if done == 0:  # training starts now: the pace leaves out decoding, data loading and evaluation before it
            self.start, self.next_line = now, now + self.interval
            return
        if now < self.next_line or done >= total:
            return
        self.next_line = now + self.interval
        elapsed = now - self.start
        left = elapsed / done * (total - done)
        late = " (past the round's deadline)" if elapsed + left > self.deadline_s else ""
        log.info(
            "%s: round %d: %d/%d steps (%.0f %%) in %.0f s, about %.0f s left%s",
            *(self.device, self.round, done, total, 100 * done / total, elapsed, left, late),
        )
