"""Gaussian noise for the round's sum, from a generator seeded afresh each round with 128 bits of OS entropy.

``numpy.random.default_rng(secrets.randbits(128))``: numpy's SeedSequence takes the whole 128-bit seed (a
``torch.Generator`` seed is 64 bits), drawn from ``secrets`` (the OS CSPRNG) per round, so no seed is stored or
reused and one round's noise says nothing about the next's. PCG64 itself is not a cryptographic generator and the
Gaussian is sampled in floating point (Mironov 2012's attack on textbook floating-point noise is not addressed):
docs/privacy.md lists both.
"""

from __future__ import annotations

import secrets

import numpy as np
import torch


class RoundNoise:
    """The Gaussian draws of one round."""

    def __init__(self) -> None:
        self._rng = np.random.default_rng(secrets.randbits(128))

    def normal(self, shape: tuple[int, ...], std: float) -> torch.Tensor:
        """N(0, std^2) per element, float64."""
        return torch.from_numpy(self._rng.normal(0.0, std, size=shape))


__all__ = ["RoundNoise"]
