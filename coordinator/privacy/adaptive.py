"""Adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy 2021): the clip norm tracks a quantile of update norms.

Each device reports one bit b_i = [||Delta_i|| <= C]. The coordinator noises their count,
b~ = (sum b_i + N(0, sigma_b^2)) / k over the k devices that reported, and steps geometrically:
C <- C * exp(-eta * (b~ - gamma)). The count is a second Gaussian release of the same sample; its noise is taken
out of the update's so the pair costs what the update alone would at the configured multiplier z:
z_update = (z^-2 - (2 sigma_b)^-2)^(-1/2) (the paper's Theorem 1 split; docs/privacy.md).
"""

from __future__ import annotations

import math


def update_noise_multiplier(total: float, count_noise: float) -> float:
    """z for the update when the count takes std ``count_noise`` out of a total multiplier ``total``."""
    rest = total**-2 - (2 * count_noise) ** -2
    if rest <= 0:
        raise ValueError(
            f"privacy.clip.count_noise {count_noise:g} leaves no noise for the update at noise multiplier {total:g}: "
            f"it must exceed {total / 2:g}"
        )
    return rest**-0.5


def default_count_noise(expected_participants: int, total: float) -> float:
    """The paper's choice, expected participants per round / 20, but at least ``total``.

    A small fleet's m / 20 is below z / 2 and would leave the update no noise; at sigma_b = z the update's
    multiplier grows by 15 % (z / sqrt(3/4)).
    """
    return max(expected_participants / 20, total)


def next_clip(clip: float, unclipped_fraction: float, quantile: float, learning_rate: float) -> float:
    """The geometric update of the clip norm from the noised fraction of unclipped devices."""
    return clip * math.exp(-learning_rate * (unclipped_fraction - quantile))


__all__ = ["default_count_noise", "next_clip", "update_noise_multiplier"]
