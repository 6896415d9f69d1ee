"""What a device's ``round_failed`` changes: its participant's answer, its plan, or its kept state."""

from __future__ import annotations

import logging

from coordinator.rounds.draw import ParticipantDraw
from coordinator.rounds.state import OpenRound, printable
from coordinator.strategies import Strategy
from device_agent.wire.messages import RoundFailed

log = logging.getLogger("fedfleet.engine")


def round_failed(
    open_: OpenRound | None, device: str, failure: RoundFailed, run_id: str, draw: ParticipantDraw, strategy: Strategy
) -> None:
    """Out of memory steps the device down; a lost kept state starts it over; a bad assignment is a bug."""
    if open_ is None or failure.run != run_id or failure.round != open_.round:
        return
    participant = open_.participants.get(device)
    if participant is None or participant.status == "accepted":
        return
    participant.status, participant.reason = "failed", failure.reason
    participant.error = f"{failure.reason}: {printable(failure.detail, 480)}"
    log.warning("round %d: %s failed: %s", open_.round, device, participant.error)
    if failure.reason == "out_of_memory":
        draw.out_of_memory(device, participant.level)
    elif failure.reason == "state_lost":
        strategy.forget(device)
        log.warning("round %d: %s lost its kept state; it gets a whole model next round", open_.round, device)
    elif failure.reason == "bad_assignment":
        log.error(
            "round %d: %s refused its assignment as not fitting the model its spec builds: a strategy bug, "
            "or a coordinator and agent of different releases",
            open_.round,
            device,
        )


__all__ = ["round_failed"]
