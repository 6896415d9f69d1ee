"""How a benchmark scores a run, summarises it over seeds and judges a claim: shared by ``compare``, its fedlora
bed and ``secagg_accuracy``.

A run's score is the mean of its last :data:`LAST_ROUNDS` rounds (one round's class mix decides less than
on the final round alone). A claim "ours >= theirs" is judged on the seed-by-seed differences of the
scores (both entries see the same split and initialization per seed): PASS when the 95 % Student-t
confidence interval of the mean difference lies above zero, TIE when it straddles zero, FAIL when it lies
below. A rule on means and standard deviations (mean + 1 std >= baseline) counted ties as passes.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Mapping, Sequence
from typing import Any

LAST_ROUNDS = 3
"""A run's score is the mean accuracy of its last rounds (as many as it has, up to this)."""
CONFIDENCE = 0.95


def last_rounds_mean(values: list[float | None]) -> float | None:
    """The mean of the last :data:`LAST_ROUNDS` known values of a run's per-round figures (None if none)."""
    known = [v for v in values[-LAST_ROUNDS:] if v is not None]
    return statistics.fmean(known) if known else None


def mean_std(values: list[float]) -> dict[str, Any]:
    """Mean, sample standard deviation, spread (largest - smallest) and every seed's value, in seed order."""
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "spread": max(values) - min(values),
        "seeds": values,
    }


def over_seeds(per_seed: Mapping[str, Sequence[float]], means_only: Collection[str] = ()) -> dict[str, Any]:
    """Each figure's summary over the seeds, in ``per_seed``'s order: :func:`mean_std` (every seed's value kept,
    for the paired claims and the reader), or just the mean for a figure named in ``means_only`` (costs such as
    bytes and seconds, which no claim is judged on)."""
    unknown = sorted(set(means_only) - set(per_seed))
    if unknown:
        raise ValueError(f"means_only names figures not given: {', '.join(unknown)}")
    return {
        name: statistics.fmean(values) if name in means_only else mean_std(list(values))
        for name, values in per_seed.items()
    }


def paired_interval(
    ours: list[float], theirs: list[float], confidence: float = CONFIDENCE
) -> tuple[float, float, float]:
    """(mean, low, high) of the seed-by-seed differences ``ours - theirs``: Student's t interval of their mean."""
    from scipy import stats

    differences = [a - b for a, b in zip(ours, theirs, strict=True)]
    mean = statistics.fmean(differences)
    if len(differences) < 2:
        return mean, -math.inf, math.inf  # one seed: no interval, nothing is separated
    half = (
        stats.t.ppf((1 + confidence) / 2, len(differences) - 1)
        * statistics.stdev(differences)
        / len(differences) ** 0.5
    )
    return mean, mean - half, mean + half


def interval_of(low: float, high: float) -> list[float] | None:
    """The interval as JSON keeps it: None for one seed's infinite one (json.dumps would write Infinity,
    which is not JSON)."""
    return [low, high] if math.isfinite(low) and math.isfinite(high) else None


def verdict(low: float, high: float) -> str:
    """PASS when the interval lies above zero, FAIL when below, TIE when it straddles zero."""
    return "PASS" if low > 0 else "FAIL" if high < 0 else "TIE"


__all__ = [
    "CONFIDENCE",
    "LAST_ROUNDS",
    "interval_of",
    "last_rounds_mean",
    "mean_std",
    "over_seeds",
    "paired_interval",
    "verdict",
]
