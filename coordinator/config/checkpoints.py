"""Which round checkpoints a run directory keeps: every round of ResNet-18 is ~43 MB, so not all of them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from pydantic import BaseModel, ConfigDict, Field


class Retention(BaseModel):
    """fleet.yaml ``checkpoints``: the last ``keep_last`` round states, plus the best one if ``keep_best``.

    Keeping more than one lets a resume fall back to an earlier state when the newest is found corrupt.
    """

    model_config = ConfigDict(extra="forbid")

    keep_last: int = Field(3, ge=1, description="round states kept, newest first (at least 1)")
    keep_best: bool = Field(True, description="also keep the state of the round with the best accuracy")


def kept_rounds(rounds: Iterable[int], accuracy: Mapping[int, float], retention: Retention) -> set[int]:
    """The rounds whose states survive pruning; ``accuracy`` maps closed rounds to their score."""
    ordered = sorted(rounds)
    kept = set(ordered[-retention.keep_last :])
    scored = [r for r in ordered if r in accuracy]
    if retention.keep_best and scored:
        kept.add(max(scored, key=lambda r: (accuracy[r], r)))
    return kept
