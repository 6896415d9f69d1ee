"""When a round stops waiting for its laggards: a grace tied to how long this round's accepted updates took.

Without it one device holds every round to the deadline: an agent that says ``idle`` once (retained) and then
stays silent looks online for the whole round, and one whose uploads the gate refuses is waited on until the
refusal grace and the deadline. A round that already has its quorum of accepted updates waits for the rest
at most ``factor`` times the median time those updates took from their assignments (or, for a device the
planner expected to be slower, its planned time scaled as this round's answers compare with their plans), and
at least ``floor`` seconds, counted from the device's own assignment (re-sent ones included, up to ``floor``
after the push); never past its deadline, and never while it is below its quorum (the quorum rule decides
then). The floor exceeds an agent's heartbeat (10 s) plus ``resend_after_s`` (5 s): a device that lost its
assignment with its connection is sent it again on its next heartbeat and still has time to answer.
A laggard cut this way is ``late`` in the round's metrics (and counts toward its backoff).
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Mapping

from coordinator.rounds.state import OpenRound

log = logging.getLogger("fedfleet.engine")


class LaggardGrace:
    """Notes when each accepted update arrived and says when the round is past its laggards' grace."""

    def __init__(self, factor: float, floor_s: float) -> None:
        self.factor = factor
        self.floor_s = floor_s

    def start(self, open_: OpenRound, device: str) -> float:
        """When ``device``'s clock started: its assignment's last sending, but no later than ``floor_s`` after the
        push (a device re-sent its assignment after a lost connection gets its time; one that keeps asking for it
        cannot hold the round longer)."""
        sent = open_.participants[device].assigned_at
        return min(max(open_.pushed, sent if sent is not None else open_.pushed), open_.pushed + self.floor_s)

    def graces(self, open_: OpenRound, estimates: Mapping[str, float | None]) -> dict[str, float]:
        """Seconds after its :meth:`start` the round waits for each participant; empty while no accepted update
        has a time.

        ``factor`` times the larger of the accepted updates' median time and the device's own planned time
        (``estimates``, the planner's) scaled as this round's answers compare with theirs: a device planned
        slower than the rest (a Pi 4 at a low level beside Jetsons) is not cut for being slow as planned.
        """
        times = {
            d: max(0.0, p.answered_at - self.start(open_, d))
            for d, p in open_.participants.items()
            if p.answered_at is not None
        }
        if not times:
            return {}
        median = statistics.median(times.values())
        ratios = [t / est for d, t in times.items() if (est := estimates.get(d))]
        scale = statistics.median(ratios) if ratios else 0.0
        return {
            d: max(self.factor * max(median, scale * (estimates.get(d) or 0.0)), self.floor_s)
            for d in open_.participants
        }

    def past(self, open_: OpenRound, quorum: int, now: float, estimates: Mapping[str, float | None]) -> bool:
        """True once the round has ``quorum`` accepted updates and each other participant is past its grace."""
        for participant in open_.participants.values():
            if participant.status == "accepted" and participant.answered_at is None:
                participant.answered_at = now
        if len(open_.accepted) < quorum:
            return False
        graces = self.graces(open_, estimates)
        waiting = sorted(d for d, p in open_.participants.items() if p.status not in ("accepted", "failed"))
        if not graces or any(now < self.start(open_, d) + graces[d] for d in waiting):
            return False
        log.warning(
            "round %d: closing without %s: %d/%d updates accepted and %.1f s since the push, past the laggards' "
            "grace (%g x the accepted updates' median time or the device's planned one, at least %g s)",
            open_.round,
            ", ".join(waiting[:10]) + (f" and {len(waiting) - 10} more" if len(waiting) > 10 else ""),
            len(open_.accepted),
            len(open_.participants),
            now - open_.pushed,
            self.factor,
            self.floor_s,
        )
        return True


__all__ = ["LaggardGrace"]
