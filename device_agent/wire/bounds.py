"""The one range of every number a device reports: its update's meta, and the clock of every control message.

Why these ranges and not merely "finite": the coordinator closes a round by summing value x count over
its devices (the federated accuracy and loss weight each device by its test samples; the aggregate
weights each update by its training samples). Finite is not enough: ``global_loss = 1.7e308`` times
``eval_samples = 2**53`` is ``inf``, and a round whose close fails on a journaled upload fails again
on every resume. Every value below ``MAX_MEASURE`` and every count below ``MAX_COUNT`` keeps a round
of a million devices below 1e21: finite in float64 with room to spare, and exact enough to be
meaningful. The bounds are generous for honest devices (a loss of a million is already a diverged
model) and the same on both sides: the agent's kit and the coordinator read this one table.

The coordinator's gate narrows the sample counts further, relative to what the fleet expects of each
device (:mod:`coordinator.rounds.upload_gate`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_COUNT = 10**9
"""Samples a device may report for one round (training or evaluation): a billion is no edge device's shard."""
MAX_MEASURE = 1e6
"""The largest loss a device may report: cross-entropy of a diverged model is in the tens."""
MAX_SECONDS = 86_400.0
"""Longer than any round deadline: a day of training for one round is a lie or a broken clock."""
MAX_CLOCK = 1e11
"""A message's ``sent_at`` (Unix seconds): year 5138; past it the sender's clock is broken or hostile."""


@dataclass(frozen=True)
class Bound:
    """The closed range ``[low, high]`` of one reported number, and what it means."""

    low: float
    high: float
    meaning: str
    integer: bool = False

    def problem(self, name: str, value: float) -> str | None:
        """Why ``value`` is not a valid ``name``, or None."""
        shown = str(value)[:30] if isinstance(value, int) else repr(value)
        if isinstance(value, float) and not math.isfinite(value):
            return f"{name}={shown} is not a finite number"
        if not self.low <= value <= self.high:
            return f"{name}={shown} is outside [{self.low:g}, {self.high:g}] ({self.meaning})"
        return None


UPLOAD_META: dict[str, Bound] = {
    "samples": Bound(1, MAX_COUNT, "training samples behind the update: its aggregation weight", integer=True),
    "train_seconds": Bound(0, MAX_SECONDS, "wall-clock seconds of local training"),
    "host_seconds": Bound(0, MAX_SECONDS, "an emulated device: the seconds its host computed"),
    "loss": Bound(-MAX_MEASURE, MAX_MEASURE, "mean training loss (a regularized objective may be negative)"),
    "local_accuracy": Bound(0, 1, "the trained model on the device's own test shard"),
    "global_accuracy": Bound(0, 1, "the received model on the device's own test shard"),
    "global_loss": Bound(0, MAX_MEASURE, "cross-entropy of the received model on that shard"),
    "eval_samples": Bound(1, MAX_COUNT, "test samples behind global_accuracy and global_loss", integer=True),
}
"""Every number of an update's manifest meta (:func:`device_agent.wire.protocol.upload_meta`), by key."""

MESSAGE_CLOCK = Bound(0, MAX_CLOCK, "the sender's Unix clock when it sent the message")
"""``sent_at`` of every control message (hello, status, ...): the only number a status carries."""


def bounded(name: str, value: float) -> str | None:
    """Why ``value`` is no valid upload meta ``name`` (:data:`UPLOAD_META`), or None."""
    return UPLOAD_META[name].problem(name, value)
