"""The privacy ledger: one charge per round, epsilon from Google's ``dp-accounting`` (RDP), kept in the run state.

The coordinator draws a fixed number m of the n eligible devices without replacement
(:class:`~coordinator.rounds.draw.ParticipantDraw`), so each round is a ``SampledWithoutReplacementDpEvent(n, m,
GaussianDpEvent(z_eff))`` under the replace-one relation (n is public; Wang, Balle, Kasiviswanathan 2019), the
event that matches that draw. Poisson sampling would need a variable round size and a fixed denominator the
strategies do not have. Under replace-one, swapping one device's data moves the sum of clipped updates by up to
2C, so with noise std z*C the event's multiplier is z_eff = z / 2 (docs/privacy.md). A round whose every eligible
device is drawn is a plain Gaussian event (q = 1). Devices that drop out after the draw stay in m.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import dp_accounting
import torch
from dp_accounting.rdp import RdpAccountant

REPLACE_ONE = dp_accounting.NeighboringRelation.REPLACE_ONE


@dataclass(frozen=True)
class RoundCharge:
    """One round as the accountant sees it."""

    population: int
    """Devices the round was drawn from (the eligible ones)."""
    sample: int
    """Devices drawn, those that dropped out or were refused included."""
    noise_multiplier: float
    """z_eff: the noise std over the round's replace-one L2 sensitivity (z / 2)."""

    def __post_init__(self) -> None:
        if not 0 < self.sample <= self.population:
            raise ValueError(f"a round draws 1..{self.population} devices, not {self.sample}")
        if self.noise_multiplier <= 0:
            raise ValueError(f"noise multiplier must be > 0, got {self.noise_multiplier}")

    def event(self) -> dp_accounting.DpEvent:
        gaussian = dp_accounting.GaussianDpEvent(self.noise_multiplier)
        if self.sample == self.population:
            return gaussian
        return dp_accounting.SampledWithoutReplacementDpEvent(self.population, self.sample, gaussian)


def epsilon(charges: Iterable[RoundCharge], delta: float) -> float:
    """The library's epsilon at ``delta`` after ``charges`` (0 for none)."""
    accountant = RdpAccountant(neighboring_relation=REPLACE_ONE)
    for charge, count in Counter(charges).items():
        accountant.compose(charge.event(), count)
    return float(accountant.get_epsilon(delta))


def poisson_epsilon(sampling_probability: float, noise_multiplier: float, steps: int, delta: float) -> float:
    """Epsilon of ``steps`` Poisson-sampled Gaussian releases (add/remove): the setting of published DP-SGD figures."""
    accountant = RdpAccountant()
    event = dp_accounting.PoissonSampledDpEvent(sampling_probability, dp_accounting.GaussianDpEvent(noise_multiplier))
    accountant.compose(event, steps)
    return float(accountant.get_epsilon(delta))


def calibrate(population: int, sample: int, rounds: int, target_epsilon: float, delta: float) -> float:
    """The noise multiplier z (std z*C on the sum) whose ``rounds`` rounds end at ``target_epsilon``."""

    def event(z: float) -> dp_accounting.DpEvent:
        return dp_accounting.SelfComposedDpEvent(RoundCharge(population, sample, z / 2).event(), rounds)

    return float(
        dp_accounting.calibrate_dp_mechanism(
            lambda: RdpAccountant(neighboring_relation=REPLACE_ONE),
            event,
            target_epsilon,
            delta,
            dp_accounting.mechanism_calibration.ExplicitBracketInterval(0.01, 10_000.0),
            tol=1e-4,
        )
    )


class Ledger:
    """The charges of the rounds so far, restorable exactly from the run state."""

    def __init__(self, delta: float, charges: Sequence[RoundCharge] = ()) -> None:
        self.delta = delta
        self.charges = list(charges)

    def epsilon(self) -> float:
        return epsilon(self.charges, self.delta)

    def epsilon_with(self, charge: RoundCharge) -> float:
        """Epsilon if one more round of ``charge`` ran."""
        return epsilon([*self.charges, charge], self.delta)

    def to_tensor(self) -> torch.Tensor:
        rows = [[c.population, c.sample, c.noise_multiplier] for c in self.charges]
        return torch.tensor(rows, dtype=torch.float64).reshape(len(rows), 3)

    @classmethod
    def from_tensor(cls, delta: float, rows: torch.Tensor) -> Ledger:
        return cls(delta, [RoundCharge(int(n), int(m), float(z)) for n, m, z in rows.tolist()])


def planned_epsilon(population: int, sample: int, rounds: int, noise_multiplier: float, delta: float) -> float:
    """Epsilon a run of ``rounds`` full rounds reaches (what ``coordinator plan`` prints)."""
    if math.isinf(noise_multiplier):
        return 0.0
    return epsilon([RoundCharge(population, sample, noise_multiplier / 2)] * rounds, delta)


__all__ = ["Ledger", "RoundCharge", "calibrate", "epsilon", "planned_epsilon", "poisson_epsilon"]
