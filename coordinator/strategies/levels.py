"""What a strategy's client level means: a FedHM rank ratio, a channel width, or nothing at all.

The strategy owns the meaning (``Strategy.levels``); planning, fleet.yaml checks and export ask it
questions instead of branching on a name, so a new strategy with a new kind of level edits no other
module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction


@dataclass(frozen=True)
class LevelScale:
    name: str
    sized: bool
    """Devices train models of different sizes; False: every device trains the whole model (level 1)."""
    factorized: bool
    """Levels are rank ratios of one factorized model: export builds one model per level."""
    describe: Callable[[float], str]

    def label(self, level: float) -> str:
        """For plan tables: "gamma 1/4", "width 0.5", "full model"."""
        return self.describe(level)

    def problem(self, level: float) -> str | None:
        """Why no client can be assigned ``level`` (None: it can)."""
        if not self.sized:
            return None if level == 1 else "it trains the whole model on every device (it has no size levels)"
        if not 0 < level <= 1:
            return f"a {self.name} level must be in (0, 1]"
        return None


RANK = LevelScale("rank", True, True, lambda level: f"gamma {Fraction(level).limit_denominator(1000)}")
WIDTH = LevelScale("width", True, False, lambda level: f"width {level:g}")
NONE = LevelScale("none", False, False, lambda _level: "full model")

__all__ = ["NONE", "RANK", "WIDTH", "LevelScale"]
